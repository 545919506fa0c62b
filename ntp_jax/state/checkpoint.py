"""Checkpoints in logical form with orbax: asynchronous saves, restore onto any plan.

A checkpoint of step ``N`` (the state after ``N`` optimizer steps) is an
orbax ``CheckpointManager`` step folder with two items:

- ``state``: the logical state (``ntp_jax.state.placement``): ``params`` and
  ``opt_state`` as arrays of real global shapes, one copy, no padding, no
  replica axis, shared units once; written by orbax's standard handler
  (tensorstore / zarr), so plain orbax reads it with any device count.
- ``meta``: JSON with the format version, ``step``, ``data_cursor``
  (sequences consumed), the ``plan`` it was written under and the ``config``.

Each logical array is laid out evenly over some devices of the first class
before it is written (``placement.read_logical``): every device writes the
pieces it holds, no host gathers the model. Restore goes through
``placement.place_logical``: the new plan's abstract state is the target,
each device reads the even pieces it needs. orbax writes a step into a
temporary folder and renames it when complete, so a step whose save did not
finish is never listed (``latest_step``).
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ntp_jax.errors import ConfigError
from ntp_jax.state.placement import BaseSource, Path, flatten, nest

FORMAT_VERSION = 1
STATE = "state"
META = "meta"


class CheckpointError(ConfigError):
  """A checkpoint that cannot be used; one line naming the path or the parameter."""


def restart_hint(directory: str | None) -> str:
  """What restarting the job resumes from, read off the disk now (no orbax, no JAX): the
  newest complete step folder under ``directory`` (None: checkpoints are off), or that none
  was written. Said to a process that stops, so that it never points to a checkpoint that
  does not exist."""
  if directory is None:
    return "restart the job: with checkpoint.every=0 it starts again from step 0"
  steps = sorted((int(name) for name in _listing(directory) if name.isdigit()), reverse=True)
  for step in steps:
    if _complete(folder := os.path.join(directory, str(step))):
      return f"restart the job: it resumes from {folder}"
  return f"restart the job: no checkpoint was written to {directory} yet, so it starts again " \
         "from step 0"


def _complete(folder: str) -> bool:
  """``folder`` holds orbax's commit metadata and both items of a step."""
  return all(os.path.exists(os.path.join(folder, part))
             for part in ("_CHECKPOINT_METADATA", STATE, META))


def _listing(directory: str) -> list[str]:
  try:
    return os.listdir(directory)
  except OSError:
    return []


def one_line(err: BaseException, limit: int = 300) -> str:
  """``Type: message`` of the innermost error of ``err``'s chain, on one line, at most
  ``limit`` characters of message: orbax wraps TensorStore's error (which names the array
  and the byte range) in one whose text is a repr of the whole store spec."""
  chain = [err]
  while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None \
      and inner not in chain:
    chain.append(inner)
  root = chain[-1]
  text = re.sub(r"\s*See full TensorStore details:.*", "", " ".join(str(root).split()))
  text = text if len(text) <= limit else text[:limit - 3] + "..."
  return f"{type(root).__name__}: {text}" if text else type(root).__name__


def _is_late_read(unraisable) -> bool:
  """TensorStore's callback of a read still in flight when a restore failed, landing on the
  event loop orbax has closed since: it says nothing the restore's error did not."""
  return (unraisable.exc_type is RuntimeError
          and str(unraisable.exc_value) == "Event loop is closed")


def quiet_late_reads() -> None:
  """From now on, drop the tracebacks that the reads still in flight after a failed restore
  print when they end (``_is_late_read``); every other unraisable error goes on to the
  hook there was. Idempotent."""
  hook = sys.unraisablehook
  if getattr(hook, "drops_late_reads", False):
    return

  def drop_late_reads(unraisable):
    if not _is_late_read(unraisable):
      hook(unraisable)
  drop_late_reads.drops_late_reads = True
  sys.unraisablehook = drop_late_reads


class Checkpoints:
  """The checkpoints of a run in one folder (``checkpoint.dir``).

  Args:
    directory: the folder (created if missing).
    keep: how many of the newest checkpoints to keep (``checkpoint.keep``).
    asynchronous: write in a background thread after the device-to-host copy.
    processes: the processes that take part (default: every process of the job);
      the lowest writes the metadata. A subset is what survives a lost process
      (``restrict``, ``training.just_in_time``).
    reads_only: a reader (``stored_run``, generation, export): it never writes, and never
      removes the temporary folders of unfinished saves, which a writer elsewhere (a run in
      progress) may be filling. A writer removes them (before its first save).

  Raises:
    CheckpointError: the folder cannot be created or read, naming it.
  """

  def __init__(self, directory: str, *, keep: int = 2, asynchronous: bool = True,
               field: str = "checkpoint.dir", processes: set[int] | None = None,
               reads_only: bool = False):
    if keep < 1:
      raise ConfigError(f"checkpoint.keep: must be >= 1, got {keep}")
    self.directory = os.path.abspath(directory)
    if os.path.exists(self.directory) and not os.path.isdir(self.directory):
      raise CheckpointError(f"{field}: {self.directory} is not a folder")
    try:
      os.makedirs(self.directory, exist_ok=True)
      os.listdir(self.directory)
    except OSError as err:
      raise CheckpointError(f"{field}: cannot use {self.directory} ({err.strerror})") from None
    self.keep, self.asynchronous = keep, asynchronous
    self.processes, self.reads_only = processes, reads_only
    self._manager = self._open(processes)

  def _open(self, processes: set[int] | None) -> ocp.CheckpointManager:
    if processes is None:
      multiprocessing = ocp.options.MultiprocessingOptions()
    else:  # orbax's barriers then wait for these processes only
      multiprocessing = ocp.options.MultiprocessingOptions(
          primary_host=min(processes), active_processes=set(processes),
          barrier_sync_key_prefix="ntp_jax_" + "_".join(map(str, sorted(processes))))
    options = ocp.CheckpointManagerOptions(max_to_keep=self.keep, create=processes is None,
                                           enable_async_checkpointing=self.asynchronous,
                                           cleanup_tmp_directories=not self.reads_only,
                                           multiprocessing_options=multiprocessing)
    try:
      return ocp.CheckpointManager(
          self.directory, options=options,
          item_handlers={STATE: ocp.StandardCheckpointHandler(),
                         META: ocp.JsonCheckpointHandler()})
    except Exception as err:  # orbax wraps OS errors in several types
      raise CheckpointError(f"checkpoint.dir: cannot open {self.directory} "
                            f"({one_line(err)})") from None

  def restrict(self, processes: set[int]) -> None:
    """From now on only ``processes`` take part (the others were lost). A save in flight
    is abandoned: its commit waits for every process, and is never listed."""
    self.processes = set(processes)
    self._manager = self._open(self.processes)

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def latest_step(self) -> int | None:
    """The newest complete step, or None.

    orbax writes a step under a temporary name and renames it when done; a
    step folder that still lacks a part (copied by hand, cut by a full disk)
    is skipped too.
    """
    for step in reversed(self.all_steps()):
      if self.is_complete(step):
        return step
    return None

  def is_complete(self, step: int) -> bool:
    """The step folder holds orbax's commit metadata and both items."""
    return _complete(self.step_dir(step))

  def check_complete(self, step: int, field: str = "--step") -> None:
    """Raises CheckpointError, naming ``field`` and the complete steps there are, unless
    ``step`` is a complete checkpoint."""
    if not self.is_complete(step):
      have = [s for s in self.all_steps() if self.is_complete(s)]
      raise CheckpointError(f"{field}: {self.step_dir(step)} is not a complete checkpoint "
                            f"(complete steps: {', '.join(map(str, have)) or 'none'})")

  def all_steps(self) -> list[int]:
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def save(self, step: int, logical: dict[Path, jax.Array], meta: dict[str, Any]) -> float:
    """Start writing a checkpoint of ``step``; returns the seconds the caller was held.

    Args:
      step: optimizer steps done.
      logical: ``path -> array`` (``placement.read_logical``); in a multi-process job
        whose arrays one process holds whole (the others lost), host copies
        (numpy), which orbax writes from the first of ``processes``.
      meta: JSON-ready dict (``data_cursor``, ``plan``, ``config``, ...).

    The call returns once the arrays are copied off the devices; the write
    goes on in the background. An earlier save that failed is raised here.

    Raises:
      CheckpointError: a save failed (this one or an earlier one).
    """
    start = time.perf_counter()
    meta = {"format": FORMAT_VERSION, "step": int(step), **meta}
    if jax.process_count() > 1 and all(
        getattr(a, "is_fully_addressable", False) for a in logical.values()):
      # orbax refuses arrays one process holds whole in a multi-process job ("host
      # local"); the same values as host arrays are written the same way.
      logical = {path: np.asarray(jax.device_get(a)) for path, a in logical.items()}
    try:
      self._manager.check_for_errors()
      self._manager.save(step, args=ocp.args.Composite(
          **{STATE: ocp.args.StandardSave(nest(logical)), META: ocp.args.JsonSave(meta)}),
          force=True)
    except Exception as err:
      raise CheckpointError(f"checkpoint.dir: saving step {step} to {self.step_dir(step)} "
                            f"failed ({one_line(err)})") from None
    return time.perf_counter() - start

  def wait(self) -> None:
    """Block until every started save is on disk.

    Raises:
      CheckpointError: a save failed.
    """
    try:
      self._manager.wait_until_finished()
      self._manager.check_for_errors()
    except Exception as err:
      raise CheckpointError(f"checkpoint.dir: a save to {self.directory} failed "
                            f"({one_line(err)})") from None

  def close(self) -> None:
    self.wait()
    self._manager.close()

  def meta(self, step: int) -> dict[str, Any]:
    """The ``meta`` item of ``step``.

    Raises:
      CheckpointError: missing or unreadable, naming the folder.
    """
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(
          **{META: ocp.args.JsonRestore()}))[META]
    except Exception as err:
      raise CheckpointError(f"checkpoint {self.step_dir(step)}: cannot read its metadata "
                            f"({one_line(err)})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
      raise CheckpointError(f"checkpoint {self.step_dir(step)}: not an ntp_jax checkpoint of "
                            f"format {FORMAT_VERSION}")
    return meta

  def shapes(self, step: int) -> dict[Path, tuple[tuple[int, ...], str]]:
    """``path -> (shape, dtype)`` of every stored logical array, read from metadata only.

    Raises:
      CheckpointError: unreadable metadata, naming the folder.
    """
    try:
      tree = self._manager.item_metadata(step)[STATE]
      leaves = flatten(dict(tree))
      return {path: (tuple(m.shape), str(m.dtype)) for path, m in leaves.items()}
    except Exception as err:
      raise CheckpointError(f"checkpoint {self.step_dir(step)}: cannot read its array "
                            f"metadata ({one_line(err)})") from None

  def source(self, step: int) -> CheckpointSource:
    """A ``placement.LogicalSource`` reading ``step``."""
    return CheckpointSource(self, step)

  def restore(self, step: int, requests: dict[Path, jax.ShapeDtypeStruct]
              ) -> dict[Path, jax.Array]:
    """Read ``requests`` (each with its target sharding) from ``step``.

    Raises:
      CheckpointError: a file is missing, truncated or corrupt, naming the folder.
    """
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(
          **{STATE: ocp.args.StandardRestore(nest(requests))}))[STATE]
    except Exception as err:
      quiet_late_reads()
      older = [s for s in self.all_steps() if s < step and self.is_complete(s)]
      hint = (f"remove it to resume from {self.step_dir(older[-1])}" if older else
              "set checkpoint.dir to a new folder to start afresh")
      raise CheckpointError(f"checkpoint {self.step_dir(step)}: a data file is missing or "
                            f"damaged ({one_line(err)}); {hint}") from None
    return flatten(dict(restored))


class CheckpointSource(BaseSource):
  """Logical arrays of one checkpoint step (a ``placement.LogicalSource``).

  Before reading anything it checks that the stored arrays are exactly the
  requested ones with the same logical shapes. ``paths`` is None (the
  ``BaseSource`` default): every leaf of the target must come from the checkpoint.
  """

  def __init__(self, checkpoints: Checkpoints, step: int):
    self.checkpoints = checkpoints
    self.step = step
    self._shapes = checkpoints.shapes(step)

  def check(self, requests: dict[Path, jax.ShapeDtypeStruct]) -> None:
    """Raises CheckpointError naming the first parameter that differs, with both shapes."""
    where = self.checkpoints.step_dir(self.step)
    # Parameters first: the first difference named is a parameter where there is one.
    for path in sorted(set(requests) | set(self._shapes), key=lambda p: (p[0] != "params", p)):
      name = "/".join(path)
      if path not in self._shapes:
        raise CheckpointError(f"checkpoint {where}: has no {name} (the model has "
                              f"{tuple(requests[path].shape)}); it was written for another "
                              "model or optimizer")
      if path not in requests:
        raise CheckpointError(f"checkpoint {where}: holds {name} {self._shapes[path][0]}, "
                              "which the model does not have; it was written for another model")
      if tuple(requests[path].shape) != self._shapes[path][0]:
        raise CheckpointError(f"checkpoint {where}: {name} has shape {self._shapes[path][0]}, "
                              f"the model expects {tuple(requests[path].shape)}")

  def describe(self) -> str:
    return f"checkpoint {self.checkpoints.step_dir(self.step)}"

  def read(self, requests: dict[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.Array]:
    self.check(requests)
    return self.checkpoints.restore(self.step, requests)

  def read_programs(self, blocks: dict[Path, jax.ShapeDtypeStruct],
                    rest: dict[Path, jax.ShapeDtypeStruct]) -> list:
    """orbax restores each request straight into its sharding: no program of ours runs."""
    return []


class CheckpointShapes(BaseSource):
  """Any checkpoint of this run, for lowering a restore ahead of time
  (``placement.Placement.lower``): every path, the default even split, and reads that run
  no program of ours (as ``CheckpointSource``'s). Reading it is an error
  (``NotImplementedError``)."""

  def read_programs(self, blocks: dict[Path, jax.ShapeDtypeStruct],
                    rest: dict[Path, jax.ShapeDtypeStruct]) -> list:
    return []

  def describe(self) -> str:
    return "a checkpoint of this run (shapes only)"
