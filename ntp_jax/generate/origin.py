"""Where a model to generate from comes from: a Hugging Face folder or a run's checkpoint.

``open_origin("hf:FOLDER" | CHECKPOINT_DIR, ...)`` gives an ``Origin``: the
model's ``GPTConfig``, a ``placement.LogicalSource`` of its parameters (each
device reads only its slice, as for training), the tokenizer file, how the
prompt is encoded, and the longest sequence the model is meant for. Every
problem is a ``ConfigError``: one line naming the flag, field or file.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

import configs.base
from models.gpt import GPT, GPTConfig, hf_folder, model_layouts
from ntp_jax.data.dataset import TOKENIZER_FILE
from ntp_jax.errors import ConfigError
from ntp_jax.interop import hf_llama
from ntp_jax.layers.shard import replica_view
from ntp_jax.parallel.programs import abstract_class_state
from ntp_jax.sharding.mesh import class_mesh
from ntp_jax.state.checkpoint import STATE, CheckpointError, Checkpoints
from ntp_jax.state.placement import BaseSource, LogicalSource, Path, nest, place_logical

HF_PREFIX = "hf:"
GPT_FACTORY = "models.gpt:model_spec"  # the model generation knows how to decode
DEFAULT_MAX_POSITIONS = 2048  # LlamaConfig's max_position_embeddings when config.json has none


@dataclasses.dataclass(frozen=True)
class Origin:
  """A model to generate from.

  Attributes:
    cfg: the model's shape and dtypes.
    source: its logical parameters (paths under ``params``).
    tokenizer: a ``tokenizers`` JSON file, or None when there is none.
    special_tokens: encode the prompt with the tokenizer's special tokens
      (a Hugging Face tokenizer's BOS); False for a run's own tokenizer,
      whose training text had none.
    max_len: the longest sequence (prompt and continuation) the model is for:
      ``max_position_embeddings`` of ``config.json``, or the run's
      ``train.seq_len``.
    max_len_field: where ``max_len`` comes from, for errors.
    description: one line for the log.
  """

  cfg: GPTConfig
  source: LogicalSource
  tokenizer: str | None
  special_tokens: bool
  max_len: int
  max_len_field: str
  description: str


def open_origin(where: str, overrides: dict[str, Any], step: int | None = None) -> Origin:
  """``hf:FOLDER``, or a run's workdir, checkpoint folder or step folder.

  Args:
    where: the ``--from`` value.
    overrides: ``{field: value}`` of the ``model`` section (``"dtype"``,
      ``"param_dtype"``, granularities ...), applied before the config is checked.
    step: the checkpoint step (default the newest complete one); not for ``hf:``.

  Raises:
    ConfigError: one line naming ``--from``, ``--step``, a ``model.`` field
      or the file at fault.
  """
  if where.startswith(HF_PREFIX):
    if step is not None:
      raise ConfigError("--step: only a checkpoint has steps; --from is a Hugging Face folder")
    return _from_hf(where[len(HF_PREFIX):], overrides)
  return _from_checkpoint(where, overrides, step)


def _model_config(section: Any, overrides: dict[str, Any], **replace) -> GPTConfig:
  section = ml_collections.ConfigDict(dict(section))
  for key, value in overrides.items():
    section[key] = value
  if section.get("factory", GPT_FACTORY) != GPT_FACTORY:
    raise ConfigError(f"model.factory: generation decodes {GPT_FACTORY} only, not "
                      f"{section.factory}")
  return GPTConfig.from_config(section, **replace)


def _from_hf(folder: str, overrides: dict[str, Any]) -> Origin:
  if not os.path.isdir(folder):
    raise ConfigError(f"--from: no folder {folder}")
  raw_path = os.path.join(folder, hf_llama.CONFIG)
  cfg = _model_config(configs.base.get_config().model, overrides,
                      **hf_llama.read_hf_config(folder))
  source = hf_llama.HFSource(folder, cfg)
  tokenizer = hf_llama.tokenizer_file(folder)
  if tokenizer is None:
    raise ConfigError(f"--from: {folder} has no {hf_llama.TOKENIZER} to encode the prompt with")
  with open(raw_path) as f:
    max_len = json.load(f).get("max_position_embeddings") or DEFAULT_MAX_POSITIONS
  return Origin(cfg, source, tokenizer, special_tokens=True, max_len=int(max_len),
                max_len_field=f"{raw_path}: max_position_embeddings",
                description=source.describe())


def _checkpoint_folder(where: str) -> tuple[str, str, int | None]:
  """``(checkpoints folder, workdir, step or None)`` of a workdir, checkpoints or step folder."""
  where = os.path.abspath(where)
  if os.path.isdir(os.path.join(where, "checkpoints")):
    return os.path.join(where, "checkpoints"), where, None
  if os.path.exists(os.path.join(where, "_CHECKPOINT_METADATA")):
    parent = os.path.dirname(where)
    name = os.path.basename(where)
    return parent, os.path.dirname(parent), int(name) if name.isdigit() else None
  return where, os.path.dirname(where), None


def _from_checkpoint(where: str, overrides: dict[str, Any], step: int | None) -> Origin:
  if not os.path.isdir(where):
    raise ConfigError(f"--from: no folder {where} (a Hugging Face folder is given as "
                      f"{HF_PREFIX}{where})")
  directory, workdir, step_of_folder = _checkpoint_folder(where)
  step = step if step is not None else step_of_folder
  checkpoints = Checkpoints(directory, asynchronous=False, field="--from")
  try:
    if step is None:
      step = checkpoints.latest_step()
      if step is None:
        hint = (f" (it holds {hf_llama.CONFIG}: give it as {HF_PREFIX}{where})"
                if os.path.isfile(os.path.join(where, hf_llama.CONFIG)) else "")
        raise ConfigError(f"--from: {where} holds no complete checkpoint{hint}")
    else:
      checkpoints.check_complete(step)
    config = checkpoints.meta(step).get("config", {})
    if "model" not in config or "train" not in config:
      raise CheckpointError(f"checkpoint {checkpoints.step_dir(step)}: its metadata holds no "
                            "model config")
    cfg = _model_config(config["model"], overrides,
                        **_hf_shape(config["model"], checkpoints.step_dir(step)))
    source = CheckpointParams(checkpoints, step)
  finally:
    checkpoints.close()
  tokenizer = run_tokenizer(config, directory, workdir)
  return Origin(cfg, source, tokenizer, special_tokens=False,
                max_len=int(config["train"]["seq_len"]),
                max_len_field=f"train.seq_len of checkpoint {checkpoints.step_dir(step)}",
                description=f"checkpoint {checkpoints.step_dir(step)} ({cfg.n_layers} layers, "
                            f"d_model {cfg.d_model}, vocabulary {cfg.vocab_size:,})")


def _hf_shape(section: dict, where: str) -> dict[str, Any]:
  """A run trained from ``model.init_from="hf:FOLDER"`` has that folder's shape (read again
  from its ``config.json``, as the trainer does); other runs: their section's."""
  try:
    folder = hf_folder(ml_collections.ConfigDict({"init_from": section.get("init_from", "")}))
    return {} if folder is None else hf_llama.read_hf_config(folder)
  except ConfigError as err:
    raise CheckpointError(f"checkpoint {where}: its config: {err}") from None


def run_tokenizer(config: dict, directory: str, workdir: str) -> str:
  """The tokenizer a run encoded its text with.

  The trainer keeps it beside the checkpoints (``directory/tokenizer.json``).
  For runs older than that copy: the ``hf:`` folder's ``tokenizer.json`` of
  ``model.init_from``, else the one in the trainer's data cache,
  ``workdir/data/<entry>/tokenizer.json`` (``ntp_jax.data.make_dataset``;
  the newest of several), ``workdir`` being the folder above ``directory``.

  Raises:
    ConfigError: naming ``--from`` when there is none (a run on ``.bin`` token ids).
  """
  beside = os.path.join(directory, TOKENIZER_FILE)
  if os.path.isfile(beside):
    return beside
  init_from = config["model"].get("init_from", "")
  if init_from.startswith(HF_PREFIX):
    given = hf_llama.tokenizer_file(init_from[len(HF_PREFIX):])
    if given is not None:
      return given
  found = sorted(glob.glob(os.path.join(workdir, "data", "*", TOKENIZER_FILE)),
                 key=os.path.getmtime)
  if found:
    return found[-1]
  data_path = config.get("data", {}).get("path", "")
  what = (f"the run read token ids from {data_path}" if data_path.endswith(".bin")
          else f"no {TOKENIZER_FILE} in {directory} or {os.path.join(workdir, 'data')}")
  raise ConfigError(f"--from: no tokenizer for this run ({what})")


class CheckpointParams(BaseSource):
  """The ``params`` of one checkpoint step (a ``placement.LogicalSource``): the optimizer
  state stays on disk. Each device reads its slice (orbax partial restore onto the
  requested shardings)."""

  def __init__(self, checkpoints: Checkpoints, step: int):
    self.where = checkpoints.step_dir(step)
    self.shapes = {p: s for p, (s, _) in checkpoints.shapes(step).items() if p[0] == "params"}

  def paths(self) -> set[Path]:
    return set(self.shapes)

  def describe(self) -> str:
    return f"checkpoint {self.where}"

  def read(self, requests: dict[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.Array]:
    """Raises CheckpointError naming the first parameter the checkpoint lacks or holds in
    another shape."""
    for path in sorted(set(requests) | set(self.shapes)):
      name = "/".join(path)
      if path not in self.shapes:
        raise CheckpointError(f"checkpoint {self.where}: has no {name}; it was written for "
                              "another model")
      if path not in requests:
        raise CheckpointError(f"checkpoint {self.where}: holds {name}, which the model does "
                              "not have; it was written for another model")
      if tuple(requests[path].shape) != self.shapes[path]:
        raise CheckpointError(f"checkpoint {self.where}: {name} has shape {self.shapes[path]}, "
                              f"the model expects {tuple(requests[path].shape)}")
    restore_args = nest({p: ocp.ArrayRestoreArgs(sharding=r.sharding, dtype=r.dtype)
                         for p, r in requests.items()})
    try:
      with ocp.PyTreeCheckpointer() as reader:
        restored = reader.restore(os.path.join(self.where, STATE), args=ocp.args.PyTreeRestore(
            item=nest(dict(requests)), restore_args=restore_args, partial_restore=True))
    except Exception as err:  # orbax wraps OS and tensorstore errors in several types
      raise CheckpointError(f"checkpoint {self.where}: cannot read its parameters "
                            f"({type(err).__name__}: {' '.join(str(err).split())[:200]})"
                            ) from None
    out = {}
    for path in requests:
      value = restored
      for key in path:
        value = value[key]
      out[path] = value
    return out


def place(origin: Origin, tp: int, failed: tuple[int, ...] = (),
          weights: tuple[float, ...] | None = None,
          devices: list[jax.Device] | None = None) -> tuple[GPT, jax.sharding.Mesh]:
  """The model of ``origin`` on one TP group of ``tp`` slots with ``failed`` ones left out.

  Returns:
    ``(model, mesh)``: the ``GPT`` in its layouts' padded blocks on a
    ``('dp', 'tp')`` mesh of one row (slot ``s`` on ``devices[s]``), filled
    from ``origin.source`` (each device reads only the slices it holds).

  Raises:
    ConfigError: naming ``mesh.tp`` when fewer than ``tp`` devices are present;
      errors of the source (naming the file or parameter).
  """
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) < tp:
    raise ConfigError(f"mesh.tp: {tp} devices needed, {len(devices)} present "
                      f"({devices[0].platform})")
  layouts = model_layouts(origin.cfg, tp, failed, weights)
  mesh = class_mesh([0], [layouts.heads.live_slots], tp, devices)
  graphdef, target = abstract_class_state(
      lambda: GPT(origin.cfg, layouts, rngs=nnx.Rngs(0)), 1, _NoOptimizer())
  placed, _ = place_logical({"params": target["params"]}, mesh, origin.source)
  return nnx.merge(graphdef, replica_view(placed["params"])), mesh


class _NoOptimizer:
  """``abstract_class_state`` wants an optimizer; generation has no optimizer state."""

  @staticmethod
  def init(params):
    return ()
