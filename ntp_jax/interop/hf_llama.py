"""Llama weights in Hugging Face format <-> the logical parameters of a Llama-style model.

The model is named by its config ``cfg``: an object with the Llama shape
fields (``vocab_size``, ``d_model``, ``d_ff``, ``n_layers``, ``n_heads``,
``n_kv_heads``, ``head_dim``, ``rope_theta``, ``norm_eps``,
``tie_embeddings``) and ``logical_shapes() -> {path: shape}`` of its
parameters, as ``models.gpt.GPTConfig`` has. This module imports no model.

A Hugging Face Llama folder holds ``config.json`` and the weights as
safetensors (``model.safetensors``, or shards listed by
``model.safetensors.index.json``). ``HFSource`` is a
``placement.LogicalSource``: each device reads only the slice of each tensor
it holds in the even layout that ``placement.place_logical`` asks for, so the
weights go into any NTP plan without a host holding the model. ``export_hf``
writes logical parameters back as such a folder (float32).

Conventions (checked against ``transformers``' ``LlamaForCausalLM`` by
``tests/integration/test_hf_llama.py``):

- ``nn.Linear`` weights are ``[out, in]``; ours are ``[in, out]``: transposed.
- The ``L`` layers' tensors are stacked on a leading layer axis
  (stacked blocks, ``ntp_jax.layers.stack``).
- RoPE: Hugging Face checkpoints of Llama already use the "half"
  (``rotate_half``) pairing of ``ntp_jax.layers.rope``: no permutation.
- GQA: query head ``n`` reads KV head ``n // group`` in both (``repeat_kv``).
- Tied embeddings (``tie_word_embeddings``): no ``lm_head.weight``; the
  model's ``tie_embeddings`` reads the embedding table transposed.

Settings the model does not implement (RoPE scaling, biases, other
activations, other model types, quantised weights) stop with a one-line
``ConfigError`` naming the key. Spec: ``transformers/models/llama``
(``modeling_llama.py``, ``configuration_llama.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: safetensors then reads BF16)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ntp_jax.errors import ConfigError
from ntp_jax.state.placement import BaseSource, Path, flatten

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
MODEL_TYPES = ("llama",)  # accepted ``model_type`` values
DEFAULT_MAX_POSITIONS = 2048  # LlamaConfig's max_position_embeddings when config.json has none
_FILE_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors dtypes read (cast on reading)
_IGNORED = (".rotary_emb.inv_freq",)  # buffers some older checkpoints hold; recomputed here


@dataclasses.dataclass(frozen=True)
class Name:
  """One logical parameter and its Hugging Face tensor(s).

  Attributes:
    path: logical path under ``params`` (as ``placement`` names it).
    hf: the tensor name; ``{i}`` stands for the layer of a stacked parameter.
    transposed: a ``nn.Linear`` weight, ``[out, in]`` in the file.
  """

  path: Path
  hf: str
  transposed: bool = False

  @property
  def layered(self) -> bool:
    return "{i}" in self.hf


_LAYER = "model.layers.{i}."
NAMES = (
    Name(("embed", "embedding"), "model.embed_tokens.weight"),
    Name(("blocks", "attn_norm", "scale"), _LAYER + "input_layernorm.weight"),
    Name(("blocks", "attn", "wq"), _LAYER + "self_attn.q_proj.weight", True),
    Name(("blocks", "attn", "wk"), _LAYER + "self_attn.k_proj.weight", True),
    Name(("blocks", "attn", "wv"), _LAYER + "self_attn.v_proj.weight", True),
    Name(("blocks", "attn", "wo"), _LAYER + "self_attn.o_proj.weight", True),
    Name(("blocks", "mlp_norm", "scale"), _LAYER + "post_attention_layernorm.weight"),
    Name(("blocks", "mlp", "gate", "kernel"), _LAYER + "mlp.gate_proj.weight", True),
    Name(("blocks", "mlp", "up", "kernel"), _LAYER + "mlp.up_proj.weight", True),
    Name(("blocks", "mlp", "down", "kernel"), _LAYER + "mlp.down_proj.weight", True),
    Name(("final_norm", "scale"), "model.norm.weight"),
    Name(("head", "kernel"), "lm_head.weight", True),
)


def names(cfg: Any) -> list[Name]:
  """The table for ``cfg``: every logical parameter once (no head when tied).

  Raises:
    ConfigError: the model has a parameter the table does not name.
  """
  shapes = logical_shapes(cfg)
  table = [n for n in NAMES if n.path in shapes]
  missing = set(shapes) - {n.path for n in table}
  if missing:
    raise ConfigError(f"model: parameter {'/'.join(min(missing))} has no Hugging Face "
                      "name in ntp_jax.interop.hf_llama.NAMES")
  return table


def logical_shapes(cfg: Any) -> dict[Path, tuple[int, ...]]:
  """``path -> logical shape`` of every parameter of the model of ``cfg`` (paths under
  ``params``): ``cfg.logical_shapes()``."""
  return dict(cfg.logical_shapes())


def hf_shape(name: Name, shape: tuple[int, ...]) -> tuple[int, ...]:
  """Shape of one file tensor of ``name`` for the logical ``shape``."""
  shape = shape[1:] if name.layered else shape
  return tuple(reversed(shape)) if name.transposed else shape


# --- config.json ----------------------------------------------------------------------------


def _load_json(path: str) -> dict:
  if not os.path.isfile(path):
    raise ConfigError(f"{path}: missing (a Hugging Face model folder has one)")
  try:
    with open(path) as f:
      raw = json.load(f)
  except (OSError, ValueError) as err:
    raise ConfigError(f"{path}: cannot read it as JSON ({err})") from None
  if not isinstance(raw, dict):
    raise ConfigError(f"{path}: not a JSON object")
  return raw


def read_hf_config(folder: str) -> dict[str, Any]:
  """Model config fields from a Hugging Face Llama ``config.json``.

  Returns:
    ``vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff,
    rope_theta, norm_eps, tie_embeddings``; missing optional keys take
    ``LlamaConfig``'s defaults (``num_key_value_heads`` = heads, ``head_dim``
    = hidden / heads, ``rope_theta`` 10000, ``rms_norm_eps`` 1e-6, untied).
    The other fields (granularities, dtypes, remat) are the
    run's to choose.

  Raises:
    ConfigError: one line naming the file and the key: a missing file or
      required key, ``model_type`` not in ``MODEL_TYPES``, ``rope_scaling``
      (or a ``rope_parameters.rope_type`` other than ``default``),
      ``attention_bias`` / ``mlp_bias`` true, ``hidden_act`` not ``silu``,
      ``quantization_config`` present.
  """
  path = os.path.join(folder, CONFIG)
  raw = _load_json(path)
  model_type = raw.get("model_type")
  if model_type not in MODEL_TYPES:
    raise ConfigError(f"{path}: model_type {model_type!r} is not supported; accepted: "
                      f"{', '.join(MODEL_TYPES)}")
  if raw.get("hidden_act", "silu") != "silu":
    raise ConfigError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (SwiGLU "
                      "needs silu)")
  for key in ("attention_bias", "mlp_bias"):
    if raw.get(key):
      raise ConfigError(f"{path}: {key} true is not supported (the model has no biases)")
  if raw.get("rope_scaling") is not None:
    raise ConfigError(f"{path}: rope_scaling {json.dumps(raw['rope_scaling'])} is not "
                      "supported (plain RoPE only)")
  if raw.get("quantization_config") is not None:
    raise ConfigError(f"{path}: quantization_config is not supported (unquantised weights only)")
  theta = raw.get("rope_theta", 10_000.0)
  rope = raw.get("rope_parameters")  # transformers >= 5 writes RoPE settings here
  if rope is not None:
    if rope.get("rope_type", "default") != "default":
      raise ConfigError(f"{path}: rope_parameters.rope_type {rope['rope_type']!r} is not "
                        "supported (plain RoPE only)")
    theta = rope.get("rope_theta", theta)
  for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size"):
    if not isinstance(raw.get(key), int):
      raise ConfigError(f"{path}: {key} is missing or not an integer")
  heads = raw["num_attention_heads"]
  head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
  return dict(vocab_size=raw["vocab_size"], d_model=raw["hidden_size"],
              n_layers=raw["num_hidden_layers"], n_heads=heads,
              n_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
              d_ff=raw["intermediate_size"], rope_theta=float(theta),
              norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
              tie_embeddings=bool(raw.get("tie_word_embeddings", False)))


def max_positions(folder: str) -> tuple[int, str]:
  """``(max_position_embeddings, where it comes from)`` of the folder's ``config.json``:
  the longest sequence its weights are meant for (``DEFAULT_MAX_POSITIONS`` when absent, as
  in ``LlamaConfig``).

  Raises:
    ConfigError: naming the file: missing, unreadable, or the value not a whole number >= 1.
  """
  path = os.path.join(folder, CONFIG)
  value = _load_json(path).get("max_position_embeddings") or DEFAULT_MAX_POSITIONS
  if (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1
      or int(value) != value):
    raise ConfigError(f"{path}: max_position_embeddings {value!r} is not a whole number >= 1")
  return int(value), f"{path}: max_position_embeddings"


def tokenizer_file(folder: str) -> str | None:
  """The folder's ``tokenizer.json`` (Hugging Face ``tokenizers`` format), or None."""
  path = os.path.join(folder, TOKENIZER)
  return path if os.path.isfile(path) else None


# --- reading --------------------------------------------------------------------------------


def tensor_files(folder: str) -> dict[str, str]:
  """``tensor name -> safetensors file`` of a folder.

  The index file when present, else every ``*.safetensors`` file's header.

  Raises:
    ConfigError: no weights, an unreadable index, a listed file missing, a
      tensor in two files (naming the file).
  """
  index = os.path.join(folder, INDEX)
  if os.path.exists(index):
    weight_map = _load_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
      raise ConfigError(f"{index}: weight_map is missing")
    files = {name: os.path.join(folder, f) for name, f in weight_map.items()}
    for path in sorted(set(files.values())):
      if not os.path.isfile(path):
        raise ConfigError(f"{path}: missing (listed in {INDEX})")
    return files
  paths = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
  if not paths:
    raise ConfigError(f"{os.path.join(folder, WEIGHTS)}: missing (no *.safetensors file "
                      f"or {INDEX} in {folder})")
  files: dict[str, str] = {}
  for path in paths:
    with _open(path) as f:
      for name in f.keys():
        if name in files:
          raise ConfigError(f"{path}: tensor {name} is also in {files[name]}")
        files[name] = path
  return files


def _open(path: str):
  try:
    return safe_open(path, framework="numpy")
  except Exception as err:  # safetensors raises its own error types
    raise ConfigError(f"{path}: not a readable safetensors file ({err})") from None


def _ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
  """A shard's index (slices, ``None`` for whole axes) as explicit unit-step slices."""
  out = []
  for s, n in zip(index, shape):
    start, stop, step = s.indices(n)
    if step != 1:
      raise ValueError(f"HFSource: strided shard index {s}")
    out.append(slice(start, stop))
  return tuple(out)


class HFSource(BaseSource):
  """Logical ``params`` of a Hugging Face Llama folder (a ``placement.LogicalSource``).

  Checks at construction (headers only, nothing read): ``config.json``
  agrees with ``cfg``, and every tensor the model needs is present with its
  shape and a float dtype. ``read`` builds each array with
  ``jax.make_array_from_callback`` from the requested sharding: a device's
  callback reads only its slice of the file tensors (``safe_open``'s
  ``get_slice``; for a stacked parameter, its slice of each layer's tensor),
  transposed to ``[in, out]`` and cast to the requested dtype. Devices
  holding the same slice (replicas, replicated leaves) share one read.

  Args:
    folder: the model folder.
    cfg: the model to fill; its shape fields, ``rope_theta``, ``norm_eps``
      and ``tie_embeddings`` must equal ``read_hf_config(folder)``.

  Raises:
    ConfigError: one line naming the field, file or tensor (see
      ``read_hf_config``, ``tensor_files``); a tensor the model does not use.
  """

  def __init__(self, folder: str, cfg: Any):
    self.folder = folder
    self.cfg = cfg
    config_path = os.path.join(folder, CONFIG)
    for key, value in read_hf_config(folder).items():
      if getattr(cfg, key) != value:
        raise ConfigError(f"model.{key}: {getattr(cfg, key)!r}, but {config_path} gives "
                          f"{value!r}")
    self.shapes = logical_shapes(cfg)
    self.names = {n.path: n for n in names(cfg)}
    self.files = tensor_files(folder)
    wanted = {n.hf.format(i=i): n for n in self.names.values()
              for i in (range(cfg.n_layers) if n.layered else (0,))}
    for tensor, path in sorted(self.files.items()):
      if tensor not in wanted and not tensor.endswith(_IGNORED) and not (
          cfg.tie_embeddings and tensor == "lm_head.weight"):
        raise ConfigError(f"{path}: tensor {tensor} is not a parameter of the model")
    with contextlib.ExitStack() as stack:
      handles = {}
      for tensor, name in wanted.items():
        if tensor not in self.files:
          raise ConfigError(f"{folder}: tensor {tensor} is missing")
        path = self.files[tensor]
        if path not in handles:
          handles[path] = stack.enter_context(_open(path))
        view = handles[path].get_slice(tensor)
        shape, want = tuple(view.get_shape()), hf_shape(name, self.shapes[name.path])
        if shape != want:
          raise ConfigError(f"{path}: tensor {tensor} has shape {shape}, the model expects {want}")
        if view.get_dtype() not in _FILE_DTYPES:
          raise ConfigError(f"{path}: tensor {tensor} has dtype {view.get_dtype()}; readable: "
                            f"{', '.join(_FILE_DTYPES)}")

  def paths(self) -> set[Path]:
    return {("params",) + p for p in self.names}

  def describe(self) -> str:
    """One line for logs: ``hf:FOLDER (config.json: 2 layers, d_model 32, ...)``."""
    c = self.cfg
    return (f"hf:{self.folder} ({CONFIG}: {c.n_layers} layers, d_model {c.d_model}, "
            f"{c.n_heads} heads / {c.n_kv_heads} KV of {c.head_dim}, d_ff {c.d_ff}, "
            f"vocabulary {c.vocab_size:,}, rope_theta {c.rope_theta:g}, "
            f"{'tied' if c.tie_embeddings else 'untied'} embeddings; "
            f"{len(set(self.files.values()))} safetensors file(s))")

  def read(self, requests: dict[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.Array]:
    """Raises ValueError naming the first request whose path or shape the folder lacks."""
    for path, request in requests.items():
      if path[0] != "params" or path[1:] not in self.names:
        raise ValueError(f"{'/'.join(path)}: not in the Hugging Face folder {self.folder}")
      if tuple(request.shape) != self.shapes[path[1:]]:
        raise ValueError(f"{'/'.join(path)}: shape {self.shapes[path[1:]]}, expected "
                         f"{tuple(request.shape)}")
    out = {}
    with contextlib.ExitStack() as stack:
      handles: dict[str, Any] = {}

      def tensor(hf: str):
        path = self.files[hf]
        if path not in handles:
          handles[path] = stack.enter_context(_open(path))
        return handles[path].get_slice(hf)

      for path, request in requests.items():
        name, shape = self.names[path[1:]], tuple(request.shape)
        pieces: dict[tuple, np.ndarray] = {}

        def piece(index, name=name, shape=shape, dtype=request.dtype, pieces=pieces):
          ranges = _ranges(index, shape)
          key = tuple((s.start, s.stop) for s in ranges)
          if key not in pieces:
            pieces[key] = np.asarray(_read_slice(tensor, name, ranges), dtype)
          return pieces[key]

        out[path] = jax.make_array_from_callback(shape, request.sharding, piece,
                                                 dtype=request.dtype)
    return out


def _read_slice(tensor, name: Name, ranges: tuple[slice, ...]) -> np.ndarray:
  """The logical slice ``ranges`` of ``name``, read from the file tensors (only that slice)."""
  def one(hf: str, rest: tuple[slice, ...]) -> np.ndarray:
    if name.transposed:  # ours [in, out] = file [out, in].T
      return np.ascontiguousarray(tensor(hf)[tuple(reversed(rest))].T)
    return tensor(hf)[rest]
  if not name.layered:
    return one(name.hf, ranges)
  layers, rest = ranges[0], ranges[1:]
  return np.stack([one(name.hf.format(i=i), rest) for i in range(layers.start, layers.stop)])


# --- writing --------------------------------------------------------------------------------


def _flat_params(params: Mapping) -> dict[Path, Any]:
  """Flat ``path -> array`` of a nested dict or a flat dict of paths; ``params`` prefix dropped."""
  if all(isinstance(k, tuple) for k in params):
    flat = dict(params)
  else:
    flat = flatten(dict(params))
  return {(p[1:] if p[0] == "params" else p): v for p, v in flat.items()}


def hf_config(cfg: Any, max_position_embeddings: int | None = None) -> dict[str, Any]:
  """The ``config.json`` of ``cfg`` (``LlamaForCausalLM``, float32 weights)."""
  config = {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
      "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_bias": False,
      "mlp_bias": False, "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": "float32",
  }
  if max_position_embeddings is not None:
    config["max_position_embeddings"] = int(max_position_embeddings)
  return config


def export_hf(logical_params: Mapping, cfg: Any, folder: str, *,
              max_position_embeddings: int | None = None) -> None:
  """Write logical parameters as a Hugging Face Llama folder.

  Args:
    logical_params: the model's logical parameters: nested (as
      ``shard.to_logical`` gives, optionally under ``"params"``) or flat by
      path tuple; numpy or JAX arrays of any float dtype.
    cfg: the model's config.
    folder: created if missing; ``config.json`` and ``model.safetensors``
      (float32, Hugging Face names) are written into it.
    max_position_embeddings: written to ``config.json`` when given (the
      training sequence length, say).

  Raises:
    ConfigError: a parameter missing, extra or of another shape, naming it.
  """
  flat = _flat_params(logical_params)
  shapes = logical_shapes(cfg)
  for path in sorted(set(flat) | set(shapes)):
    name = "params/" + "/".join(path)
    if path not in flat:
      raise ConfigError(f"{name}: missing from the parameters to export")
    if path not in shapes:
      raise ConfigError(f"{name}: not a parameter of the model (model.tie_embeddings="
                        f"{cfg.tie_embeddings})")
    if tuple(np.shape(flat[path])) != shapes[path]:
      raise ConfigError(f"{name}: shape {tuple(np.shape(flat[path]))}, the model has "
                        f"{shapes[path]}")
  tensors = {}
  for name in names(cfg):
    value = np.asarray(jax.device_get(flat[name.path]), np.float32)
    for i in range(cfg.n_layers) if name.layered else (None,):
      t = value if i is None else value[i]
      tensors[name.hf.format(i=i)] = np.ascontiguousarray(t.T if name.transposed else t)
  os.makedirs(folder, exist_ok=True)
  # transformers loads safetensors only with this metadata.
  save_file(tensors, os.path.join(folder, WEIGHTS), metadata={"format": "pt"})
  new_file_mode(os.path.join(folder, WEIGHTS))
  with open(os.path.join(folder, CONFIG), "w") as f:
    json.dump(hf_config(cfg, max_position_embeddings), f, indent=2)
    f.write("\n")


def new_file_mode(path: str) -> None:
  """Give ``path`` the mode a file opened for writing gets (0666 less the umask: world-readable
  under the usual 022). safetensors writes through a temporary file, created 0600, that it
  renames into place."""
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)


__all__ = ["HFSource", "NAMES", "Name", "export_hf", "hf_config", "logical_shapes", "names",
           "new_file_mode", "read_hf_config", "tensor_files", "tokenizer_file"]
