"""Where a model to generate from comes from: a Hugging Face folder or a run's checkpoint.

``open_origin("hf:FOLDER" | CHECKPOINT_DIR, ...)`` gives an ``Origin``: the
model's ``ModelSpec`` (its factory named by the run's ``model.factory``, and
``Decoding``: how it decodes), a ``placement.LogicalSource`` of its
parameters (each device reads only its slice, as for training), the
tokenizer file, how the prompt is encoded, and the longest sequence the
model is meant for. Generation knows no model: everything model-specific
(the shape of a folder, its weights and tokenizer, its longest sequence)
comes from the spec. Every problem is a ``ConfigError``: one line naming
the flag, field or file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

from ntp_jax.data.dataset import TOKENIZER_FILE
from ntp_jax.errors import ConfigError, too_few_devices
from ntp_jax.layers.shard import replica_view
from ntp_jax.model import ModelSpec, load_model_spec
from ntp_jax.parallel.programs import abstract_class_state
from ntp_jax.sharding.layout import live_slots
from ntp_jax.sharding.mesh import class_mesh
from ntp_jax.state.checkpoint import STATE, CheckpointError
from ntp_jax.state.placement import BaseSource, LogicalSource, Path, nest, place_logical
from ntp_jax.training.stored_run import StoredRun, open_stored_run

HF_PREFIX = "hf:"
HF_CONFIG = "config.json"  # what a Hugging Face folder holds (for a hint)
# The model a folder is read as unless ``--config.model.factory`` names another: a name
# imported when used (the library imports no model).
HF_FACTORY = "models.gpt:model_spec"
TRAINER_FIELDS = ("factory", "init_from")  # ``model.*`` fields the library reads itself


@dataclasses.dataclass(frozen=True)
class Origin:
  """A model to generate from.

  Attributes:
    spec: the model (``spec.decoding`` is set: ``open_origin`` refuses a model
      that cannot decode).
    source: its logical parameters (paths under ``params``).
    tokenizer: a ``tokenizers`` JSON file.
    special_tokens: encode the prompt with the tokenizer's special tokens
      (a Hugging Face tokenizer's BOS); False for a run's own tokenizer,
      whose training text had none.
    max_len: the longest sequence (prompt and continuation) the model is for:
      the spec's ``decoding.max_len`` for a folder (the GPT: ``config.json``'s
      ``max_position_embeddings``), or the run's ``train.seq_len``.
    max_len_field: where ``max_len`` comes from, for errors.
    description: one line for the log.
  """

  spec: ModelSpec
  source: LogicalSource
  tokenizer: str
  special_tokens: bool
  max_len: int
  max_len_field: str
  description: str


def open_origin(where: str, overrides: Mapping[str, Any], step: int | None = None) -> Origin:
  """``hf:FOLDER``, or a run's workdir, checkpoint folder or step folder.

  Args:
    where: the ``--from`` value.
    overrides: ``{field: value}`` of the ``model`` section (``"dtype"``,
      ``"param_dtype"``, granularities ..., ``"factory"``); a text value is typed as
      the field (``Decoding.fields``, else the stored section) before the spec is made.
    step: the checkpoint step (default the newest complete one); not for ``hf:``.

  Raises:
    ConfigError: one line naming ``--from``, ``--step``, a ``--config.model.`` field,
      the file at fault, or ``model.factory`` when its model cannot decode
      (``ModelSpec.decoding`` is None).
  """
  overrides = dict(overrides)
  if "init_from" in overrides:
    raise ConfigError("--config.model.init_from: --from says where the weights come from")
  if where.startswith(HF_PREFIX):
    if step is not None:
      raise ConfigError("--step: only a checkpoint has steps; --from is a Hugging Face folder")
    return _from_hf(where[len(HF_PREFIX):], overrides)
  return _from_checkpoint(where, overrides, step)


def _decoding_spec(spec: ModelSpec, factory: str) -> ModelSpec:
  if spec.decoding is None:
    raise ConfigError(f"model.factory: {factory} makes a model that cannot decode "
                      "(its ModelSpec has no decoding: a cached forward, docs/custom_model.md)")
  return spec


def _with_overrides(spec: ModelSpec, config: ml_collections.ConfigDict,
                    overrides: dict[str, Any]) -> ModelSpec:
  """The spec of ``config`` with the ``model`` overrides (not ``factory``, already in
  ``config``) checked and typed by the fields of ``spec`` (made without them)."""
  if not overrides:
    return spec
  fields = spec.decoding.fields
  if fields is None:
    fields = {k: v for k, v in config.model.items() if k not in TRAINER_FIELDS}
  model = dict(config.model)
  for name, value in overrides.items():
    if name not in fields:
      raise ConfigError(f"--config.model.{name}: no such model field "
                        f"({', '.join(fields) or 'the model has none to set'})")
    model[name] = _typed(name, value, fields[name])
  config = ml_collections.ConfigDict({**config, "model": model})
  return _decoding_spec(load_model_spec(config.model.factory, config), config.model.factory)


def _typed(name: str, value: Any, like: Any) -> Any:
  """``value`` (text from the command line, or a value) as the type of ``like``."""
  if not isinstance(value, str) or isinstance(like, str):
    return value
  kind = type(like).__name__
  try:
    if isinstance(like, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError
      return value.lower() in ("true", "1")
    if isinstance(like, (int, float)):
      return type(like)(value)
  except ValueError:
    raise ConfigError(f"--config.model.{name}: expected {kind}, got {value!r}") from None
  raise ConfigError(f"--config.model.{name}: a {kind} field; it cannot be set from the "
                    "command line")


def _from_hf(folder: str, overrides: dict[str, Any]) -> Origin:
  """The model ``model.factory`` makes of the folder (``model.init_from = "hf:FOLDER"``):
  its ``initial_source`` gives the weights, ``tokenizer_file`` the tokenizer and
  ``decoding.max_len`` the longest sequence."""
  if not os.path.isdir(folder):
    raise ConfigError(f"--from: no folder {folder}")
  factory = overrides.pop("factory", HF_FACTORY)
  # Only what the factory needs to read a folder: its own defaults give the rest.
  config = ml_collections.ConfigDict({
      "model": {"factory": factory, "init_from": HF_PREFIX + folder}, "train": {"seed": 0}})
  try:
    spec = load_model_spec(factory, config)
  except (AttributeError, KeyError) as err:  # a factory that reads fields a folder lacks
    raise ConfigError(f"--from: {factory} cannot make a model of a folder: it reads "
                      f"{' '.join(str(err).split()).strip(chr(34) + chr(39))[:120]!r} of the "
                      "config, which holds only "
                      "model.factory, model.init_from and train.seed (docs/custom_model.md)"
                      ) from None
  spec = _with_overrides(_decoding_spec(spec, factory), config, overrides)
  if spec.initial_source is None:
    raise ConfigError(f"--from: {factory} reads no weights from a folder (its ModelSpec "
                      f"has no initial_source for model.init_from={HF_PREFIX}{folder})")
  source = spec.initial_source()
  if spec.tokenizer_file is None:
    raise ConfigError(f"--from: {folder} has no {TOKENIZER_FILE} to encode the prompt with")
  if spec.decoding.max_len is None:
    raise ConfigError(f"--from: {factory} does not say the longest sequence of {folder} "
                      "(its ModelSpec's decoding.max_len)")
  describe = getattr(source, "describe", None)
  return Origin(spec, source, spec.tokenizer_file, special_tokens=True,
                max_len=spec.decoding.max_len, max_len_field=spec.decoding.max_len_field,
                description=describe() if describe else f"{HF_PREFIX}{folder}")


def _from_checkpoint(where: str, overrides: dict[str, Any], step: int | None) -> Origin:
  if not os.path.isdir(where):
    raise ConfigError(f"--from: no folder {where} (a Hugging Face folder is given as "
                      f"{HF_PREFIX}{where})")
  hint = (f" (it holds {HF_CONFIG}: give it as {HF_PREFIX}{where})"
          if os.path.isfile(os.path.join(where, HF_CONFIG)) else "")
  run = open_stored_run(where, step, field="--from", hint=hint)
  factory = overrides.pop("factory", None) or run.factory
  spec = _decoding_spec(run.model_spec(factory), factory)
  if run.seq_len is None:
    raise CheckpointError(f"checkpoint {run.step_dir}: its config has no train.seq_len, the "
                          "longest sequence to generate")
  spec = _with_overrides(spec, _with_factory(run.config, factory), overrides)
  return Origin(spec, CheckpointParams(run), run_tokenizer(run, spec), special_tokens=False,
                max_len=int(run.seq_len), max_len_field=f"train.seq_len of checkpoint "
                                                     f"{run.step_dir}",
                description=f"checkpoint {run.step_dir} ({spec.name}, "
                            f"{spec.param_count:,} parameters, vocabulary {spec.vocab_size:,})")


def _with_factory(config: ml_collections.ConfigDict, factory: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict({**config, "model": {**config.model, "factory": factory}})


def run_tokenizer(run: StoredRun, spec: ModelSpec) -> str:
  """The tokenizer a run encoded its text with.

  The trainer keeps it beside the checkpoints (``StoredRun.tokenizer_file``).
  For runs older than that copy: the model's own (``spec.tokenizer_file``: the
  GPT's is the ``tokenizer.json`` of a ``model.init_from="hf:FOLDER"``), else
  the newest in the trainer's data cache (``StoredRun.cached_tokenizer``).

  Raises:
    ConfigError: naming ``--from`` when there is none (a run on ``.bin`` token ids).
  """
  found = run.tokenizer_file or spec.tokenizer_file or run.cached_tokenizer()
  if found is not None:
    return found
  what = (f"the run read token ids from {run.data_path}" if run.data_path.endswith(".bin")
          else f"no {TOKENIZER_FILE} in {run.directory} or "
               f"{os.path.join(run.workdir, 'data')}")
  raise ConfigError(f"--from: no tokenizer for this run ({what})")


class CheckpointParams(BaseSource):
  """The ``params`` of one checkpoint step (a ``placement.LogicalSource``): the optimizer
  state stays on disk. Each device reads its slice (orbax partial restore onto the
  requested shardings)."""

  def __init__(self, run: StoredRun):
    self.where = run.step_dir
    self.shapes = {p: s for p, (s, _) in run.param_shapes.items()}

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
          devices: list[jax.Device] | None = None) -> tuple[nnx.Module, jax.sharding.Mesh]:
  """The model of ``origin`` on one TP group of ``tp`` slots with ``failed`` ones left out.

  Returns:
    ``(model, mesh)``: the module (``origin.spec.decoding.make``, a
    ``CachedForward``) in its layouts' padded blocks on a ``('dp', 'tp')`` mesh
    of one row (slot ``s`` on ``devices[s]``), filled from ``origin.source``
    (each device reads only the slices it holds).

  Raises:
    ConfigError: naming ``mesh.tp`` when fewer than ``tp`` devices are present;
      errors of the source (naming the file or parameter).
  """
  devices = list(jax.devices() if devices is None else devices)
  if len(devices) < tp:
    raise too_few_devices(("mesh.tp",), tp, len(devices), devices[0].platform)
  layouts = origin.spec.layouts(tp, failed, weights)
  mesh = class_mesh([0], [live_slots(tp, failed)], tp, devices)
  graphdef, target = abstract_class_state(
      lambda: origin.spec.decoding.make(layouts), 1, _NoOptimizer())
  placed, _ = place_logical({"params": target["params"]}, mesh, origin.source)
  return nnx.merge(graphdef, replica_view(placed["params"])), mesh


class _NoOptimizer:
  """``abstract_class_state`` wants an optimizer; generation has no optimizer state."""

  @staticmethod
  def init(params):
    return ()
