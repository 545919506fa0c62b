"""One reader of a stored run: a checkpoint step's metadata, typed, with the run's config.

A checkpoint step (``ntp_jax.state.checkpoint``) keeps a JSON ``meta`` item:
the format, ``step``, ``data_cursor`` (sequences consumed), the ``plan`` it
was written under (``Plan.summary``), the run's ``config`` as written, and
``just_in_time`` for a just-in-time checkpoint. ``StoredRun`` is that item
checked once; resuming (``training.resume``), generation (``ntp_jax.generate``)
and the Hugging Face export (``ntp_jax.interop.export_hf``) read a run only
through it.

Older checkpoints lack some of it; what they may lack is decided here, in
one place: any config field (``written`` gives None, and the properties say
what stands in), the plan and the data cursor (None: a resume refuses such a
checkpoint, generation and the export do not need them).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Mapping
from typing import Any

import ml_collections

from ntp_jax.data.dataset import TOKENIZER_FILE
from ntp_jax.errors import ConfigError
from ntp_jax.model import ModelSpec, load_model_spec
from ntp_jax.state.checkpoint import META, CheckpointError, Checkpoints
from ntp_jax.state.placement import Path

ParamShapes = Mapping[Path, tuple[tuple[int, ...], str]]  # path -> (logical shape, dtype)


@dataclasses.dataclass(frozen=True)
class StoredRun:
  """One complete checkpoint step of a run.

  Attributes:
    directory: the checkpoints folder (absolute).
    workdir: the folder above it: the run's workdir, which holds its data cache.
    step: the step (optimizer steps done).
    config: the run's config as written (JSON as a ``ConfigDict``, the
      learning-rate schedule's length resolved); older checkpoints may lack
      fields or sections (``written``).
    plan: the ``Plan.summary()`` it was written under, or None (metadata without one).
    data_cursor: sequences of the data walk consumed, or None (metadata without one).
    just_in_time: written by the survivors of a lost process (``training.just_in_time``).
    param_shapes: ``path -> (logical shape, dtype)`` of the stored ``params``
      (paths start with ``"params"``), from orbax's metadata; None when not read
      (``read_stored_run(..., param_shapes=False)``).
  """

  directory: str
  workdir: str
  step: int
  config: ml_collections.ConfigDict
  plan: dict[str, Any] | None
  data_cursor: int | None
  just_in_time: bool = False
  param_shapes: ParamShapes | None = None

  @property
  def step_dir(self) -> str:
    return os.path.join(self.directory, str(self.step))

  def written(self, name: str) -> Any:
    """The config's ``section.field`` as written (``"train.seq_len"``), or None where this
    checkpoint's config lacks it (older checkpoints)."""
    node: Any = self.config
    for part in name.split("."):
      if not isinstance(node, ml_collections.ConfigDict) or part not in node:
        return None
      node = node[part]
    return node

  @property
  def seq_len(self) -> int | None:
    """``train.seq_len``: the length of the sequences ``data_cursor`` counts; None if absent."""
    return self.written("train.seq_len")

  @property
  def schedule_steps(self) -> int | None:
    """The learning-rate schedule's length: ``train.schedule_steps``, or ``train.steps`` in
    checkpoints that predate it; None if neither is there."""
    given = self.written("train.schedule_steps")
    return self.written("train.steps") if given is None else given

  @property
  def factory(self) -> str | None:
    """``model.factory``: the model the run trained; None when its config names none."""
    return self.written("model.factory") or None

  @property
  def init_from(self) -> str:
    """``model.init_from``: ``""`` (random init, also when absent) or ``"hf:FOLDER"``."""
    return self.written("model.init_from") or ""

  @property
  def data_path(self) -> str:
    """``data.path``: ``""`` (the standard library's source, also when absent) or the data."""
    return self.written("data.path") or ""

  @property
  def tokenizer_file(self) -> str | None:
    """The tokenizer the trainer keeps beside the checkpoints (``directory/tokenizer.json``),
    or None: a run on ``.bin`` token ids, or one older than that copy."""
    path = os.path.join(self.directory, TOKENIZER_FILE)
    return path if os.path.isfile(path) else None

  def cached_tokenizer(self) -> str | None:
    """The newest ``tokenizer.json`` of the trainer's data cache
    (``workdir/data/<entry>/tokenizer.json``, ``ntp_jax.data.make_dataset``), or None."""
    found = sorted(glob.glob(os.path.join(self.workdir, "data", "*", TOKENIZER_FILE)),
                   key=os.path.getmtime)
    return found[-1] if found else None

  def model_spec(self, factory: str | None = None) -> ModelSpec:
    """The ``ModelSpec`` that ``factory`` (default the config's ``model.factory``) makes of
    the stored config; a run trained from ``model.init_from="hf:FOLDER"`` reads that
    folder again (the GPT takes its shape from its ``config.json``).

    Raises:
      CheckpointError: naming the step folder: the config has no ``model`` section or
        names no ``model.factory``, or the factory refuses it (its error in the line).
    """
    if self.written("model") is None:
      raise CheckpointError(f"checkpoint {self.step_dir}: its metadata holds no model config")
    factory = factory or self.factory
    if not factory:
      raise CheckpointError(f"checkpoint {self.step_dir}: its config names no model.factory")
    try:
      return load_model_spec(factory, self.config)
    except ConfigError as err:
      raise CheckpointError(f"checkpoint {self.step_dir}: its config: {err}") from None


def locate(where: str) -> tuple[str, int | None]:
  """``(checkpoints folder, step or None)`` of a run's workdir (it holds ``checkpoints``),
  a checkpoints folder, or one step folder (``checkpoints/150``: that step)."""
  where = os.path.abspath(where)
  if os.path.isdir(os.path.join(where, "checkpoints")):
    return os.path.join(where, "checkpoints"), None
  if os.path.exists(os.path.join(where, "_CHECKPOINT_METADATA")):
    name = os.path.basename(where)
    return os.path.dirname(where), int(name) if name.isdigit() else None
  return where, None


def open_stored_run(where: str, step: int | None = None, *, field: str,
                    hint: str = "") -> StoredRun:
  """The stored run at ``where`` (a workdir, a checkpoints folder or a step folder), with the
  shapes of its parameters.

  Args:
    where: the folder as given.
    step: the step (default that of a step folder, else the newest complete one).
    field: the flag or field ``where`` came from, for errors (``"--from"``).
    hint: appended to the error when ``where`` holds no complete checkpoint.

  Raises:
    CheckpointError: one line naming ``field`` (no folder, no complete checkpoint),
      ``--step`` (not a complete step), or the step's metadata file (unreadable, not an
      ntp_jax checkpoint, a field of the wrong type).
  """
  if not os.path.isdir(where):
    raise CheckpointError(f"{field}: no folder {where}")
  directory, step_of_folder = locate(where)
  step = step if step is not None else step_of_folder
  checkpoints = Checkpoints(directory, asynchronous=False, field=field, reads_only=True)
  try:
    if step is None:
      step = checkpoints.latest_step()
      if step is None:
        raise CheckpointError(f"{field}: {where} holds no complete checkpoint{hint}")
    else:
      checkpoints.check_complete(step)
    return read_stored_run(checkpoints, step)
  finally:
    checkpoints.close()


def read_stored_run(checkpoints: Checkpoints, step: int, *,
                    param_shapes: bool = True) -> StoredRun:
  """Step ``step`` of ``checkpoints`` (a complete one), its metadata checked.

  Args:
    param_shapes: also read the shapes of the stored parameters (orbax's array
      metadata); a resume does not need them here.

  Raises:
    CheckpointError: naming the step's metadata file: unreadable, not an ntp_jax
      checkpoint of this format, or ``step``, ``data_cursor``, ``plan`` or
      ``config`` of the wrong type.
  """
  meta = checkpoints.meta(step)
  where = os.path.join(checkpoints.step_dir(step), META)

  def bad(name: str, value: Any, want: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {where}: {name} is {value!r:.80}, not {want}")

  def whole(name: str) -> int | None:
    value = meta.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 0):
      raise bad(name, value, "a whole number >= 0")
    return value

  written_step, cursor = whole("step"), whole("data_cursor")
  if written_step is not None and written_step != step:
    raise CheckpointError(f"checkpoint {where}: says step {written_step}, in the folder of "
                          f"step {step}")
  plan = meta.get("plan")
  if plan is not None and not (isinstance(plan, dict) and isinstance(plan.get("replicas"), list)):
    raise bad("plan", plan, "a plan summary")
  config = meta.get("config", {})
  if not isinstance(config, dict):
    raise bad("config", config, "a mapping")
  try:
    config = ml_collections.ConfigDict(config)
  except Exception as err:  # keys ml_collections refuses
    raise CheckpointError(f"checkpoint {where}: config cannot be read as a ConfigDict "
                          f"({type(err).__name__}: {err})") from None
  shapes = None
  if param_shapes:
    shapes = {p: s for p, s in checkpoints.shapes(step).items() if p[0] == "params"}
  return StoredRun(directory=checkpoints.directory,
                   workdir=os.path.dirname(checkpoints.directory), step=step, config=config,
                   plan=plan, data_cursor=cursor, just_in_time=bool(meta.get("just_in_time")),
                   param_shapes=shapes)
