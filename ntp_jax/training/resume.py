"""Where a run starts: the latest checkpoint (and what happened before it), or step 0.

A checkpoint holds the step, the data cursor (sequences consumed), the plan
it was written under and the config (``state.checkpoint``). Resuming checks
that the cursor still means the same sequences, replays the events before
the resumed step onto the launch failures, and plans for the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optax

from ntp_jax.errors import ConfigError
from ntp_jax.model import ModelSpec
from ntp_jax.parallel.plan import Plan
from ntp_jax.parallel.programs import abstract_class_state
from ntp_jax.resilience.events import Event
from ntp_jax.state.checkpoint import CheckpointError, Checkpoints
from ntp_jax.state.placement import LogicalSource, Path, leaves_of
from ntp_jax.training.config import RunConfig
from ntp_jax.training.stored_run import StoredRun, read_stored_run

# Fields that decide which sequences a data cursor means: another value changes the order.
DATA_ORDER_FIELDS = (("train", "seed"), ("data", "path"), ("data", "max_corpus_bytes"),
                     ("data", "val_fraction"))


@dataclasses.dataclass(frozen=True)
class ResumePoint:
  """Where the run starts.

  Attributes:
    step: the first step to run (0 for a fresh run).
    cursor: sequences of the data walk consumed before it.
    source: the checkpoint's state (``LogicalSource``), or None: a fresh start.
    failed: the failed ``(replica, slot)`` pairs at ``step``: the launch
      failures with the events before ``step`` applied.
    events: the events still to come (at ``step`` or later).
    plan: the plan for ``failed``.
    done: the checkpoint already reached ``train.steps``: nothing to run.
  """

  step: int
  cursor: int
  source: LogicalSource | None
  failed: frozenset[tuple[int, int]]
  events: tuple[Event, ...]
  plan: Plan
  done: bool = False


def resume_point(config: RunConfig, checkpoints: Checkpoints | None, plan: Plan,
                 make_plan: Callable[[frozenset], Plan], log) -> ResumePoint:
  """From the latest checkpoint when there is one (and ``checkpoint.resume``), else step 0.

  Raises:
    ConfigError: naming ``train.seq_len`` when the checkpoint's differs (see
      ``check_same_data``).
  """
  fresh = ResumePoint(0, 0, None, config.ntp.failed, config.ntp.events, plan)
  if checkpoints is None or not config.checkpoint.resume:
    return fresh
  latest = checkpoints.latest_step()
  if latest is None:
    return fresh
  stored = read_stored_run(checkpoints, latest, param_shapes=False)
  check_same_data(config, stored, log)
  check_same_schedule(config, stored, log)
  if stored.plan is None or stored.data_cursor is None:
    missing = "plan" if stored.plan is None else "data_cursor"
    raise CheckpointError(f"checkpoint {stored.step_dir}: its metadata has no {missing}, so "
                          "the run cannot resume from it; start afresh in another "
                          "checkpoint.dir")
  log(f"resuming from step {latest} of {stored.step_dir}")
  log(f"  written under: {describe_written_plan(stored.plan)}")
  cursor, source = stored.data_cursor, checkpoints.source(latest)
  if latest >= config.train.steps:
    log(f"step {latest} already reached train.steps={config.train.steps}; nothing to do")
    return dataclasses.replace(fresh, step=latest, cursor=cursor, done=True)
  # Events before the resumed step have happened: start from their failed set.
  failed = set(config.ntp.failed)
  for e in (e for e in config.ntp.events if e.step < latest):
    (failed.add if e.kind == "fail" else failed.discard)((e.replica, e.slot))
  failed = frozenset(failed)
  return ResumePoint(latest, cursor, source, failed,
                     tuple(e for e in config.ntp.events if e.step >= latest), make_plan(failed))


def check_resumable(config: RunConfig, checkpoints: Checkpoints | None,
                    logical: dict[Path, Any] | None = None) -> None:
  """What ``resume_point`` and the restore would refuse of the latest checkpoint, checked
  before the data is read (a tokenizer may take many seconds to train first).

  Args:
    logical: ``path -> jax.ShapeDtypeStruct`` of the logical state the run restores
      (``logical_requests``); None skips the shape check.

  Raises:
    ConfigError: naming ``checkpoint.resume`` when it is False and the folder holds
      checkpoints (see ``check_fresh``); naming ``train.seq_len`` (see
      ``check_seq_len``); ``CheckpointError`` naming the checkpoint and the first array
      whose shape differs (another vocabulary, another model).
  """
  if checkpoints is None:
    return
  if not config.checkpoint.resume:
    check_fresh(checkpoints)
    return
  latest = checkpoints.latest_step()
  if latest is not None:
    check_seq_len(config, read_stored_run(checkpoints, latest, param_shapes=False))
    if logical is not None:
      checkpoints.source(latest).check(logical)


def check_fresh(checkpoints: Checkpoints) -> None:
  """A fresh run (``checkpoint.resume=False``) needs a checkpoint folder of its own: in one
  that holds another run's steps, its saves would delete the oldest of them (``keep``) and
  the next resume would continue the other run.

  Raises:
    ConfigError: naming ``checkpoint.resume``, the folder and its steps.
  """
  steps = checkpoints.all_steps()
  if steps:
    raise ConfigError(f"checkpoint.resume=False: {checkpoints.directory} holds checkpoints of "
                      f"an earlier run (steps {', '.join(map(str, steps))}); a fresh run needs "
                      "a folder of its own: set checkpoint.dir (or workdir) to a new folder, or "
                      "move that one aside")


def logical_requests(model: ModelSpec, plan: Plan,
                     optimizer: optax.GradientTransformation) -> dict[Path, Any]:
  """``path -> jax.ShapeDtypeStruct`` (logical shape and dtype) of the state a checkpoint
  of this model and optimizer holds; from shapes only, nothing allocated."""
  _, state = abstract_class_state(lambda: model.make(plan.logical_layouts), 1, optimizer)
  return {leaf.path: leaf.abstract() for leaf in leaves_of(state)[0]}


def check_seq_len(config: RunConfig, stored: StoredRun) -> None:
  """Raises ConfigError naming ``train.seq_len`` when the checkpoint's differs (one without
  it is not checked)."""
  old = stored.seq_len
  if old is not None and old != config.train.seq_len:
    raise ConfigError(f"train.seq_len: the checkpoint {stored.step_dir} was written with "
                      f"train.seq_len={old}; its data position counts sequences of that "
                      f"length (now {config.train.seq_len}); resume with {old} or start afresh "
                      "in another checkpoint.dir")


def check_same_data(config: RunConfig, stored: StoredRun, log) -> None:
  """The checkpoint's data position must mean the same sequences in this run.

  Raises:
    ConfigError: naming ``train.seq_len`` when it differs from the checkpoint's
      (the cursor counts sequences of that length). Another seed, data path,
      byte budget or vocabulary gets a one-line warning: the order changes.
  """
  check_seq_len(config, stored)
  now = {(s, f): getattr(getattr(config, s), f) for s, f in DATA_ORDER_FIELDS}
  if "vocab_size" in config.source.model:  # the model factory's field, as configured
    now[("model", "vocab_size")] = config.source.model["vocab_size"]
  for (section, field), value in now.items():
    before = stored.written(f"{section}.{field}")  # None: an older checkpoint lacks it
    if before is not None and before != value:
      log(f"warning: {section}.{field} was {before!r} when {stored.step_dir} was written, now "
          f"{value!r}: the data order differs from the first run")


def check_same_schedule(config: RunConfig, stored: StoredRun, log) -> None:
  """One line when the learning-rate schedule differs from the checkpoint's: its length
  (``StoredRun.schedule_steps``), warmup, peak or floor. The run goes on, on this run's
  schedule from the resumed step."""
  before = {"schedule_steps": stored.schedule_steps,
            **{k: stored.written(f"train.{k}") for k in ("warmup_steps", "lr", "min_lr_ratio")}}
  changed = [f"train.{k}={before[k]!r} -> {getattr(config.train, k)!r}" for k in before
             if before[k] is not None and before[k] != getattr(config.train, k)]
  if changed:
    log(f"warning: the learning-rate schedule differs from the one {stored.step_dir} was "
        f"written with ({', '.join(changed)}): the rate follows this run's curve from here, and "
        "the step compiles anew (the schedule is part of its program); set "
        "train.schedule_steps to the final step count to train in parts on one curve")


def describe_written_plan(summary: dict[str, Any]) -> str:
  """One line for the plan a checkpoint was written under (``Plan.summary``)."""
  replicas = "; ".join(f"replica {r['replica']}: TP degree {len(r['live_slots'])}, slots "
                       f"{','.join(map(str, r['live_slots']))}" for r in summary["replicas"])
  return (f"mesh.dp={summary['dp']} x mesh.tp={summary['tp']} ({replicas}), "
          f"{summary['global_batch']} sequences per step")
