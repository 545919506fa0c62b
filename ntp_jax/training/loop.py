"""One training run: steps, checkpoints, failures and repairs while it runs, goodput.

``trainer.train`` sets up the config, plan and data and hands over to
``TrainingRun``. Events (``events.Event``) change the set of failed slots
before a step (or inside it, ``mid``); the run then re-plans and moves the
live state onto the new plan (``ntp.recovery="live"``: from DP peers, see
``ntp_jax.state.peer``) or restores the last checkpoint onto it
(``"restart"``, and the fallback when no live copy exists).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ntp_jax.analysis.hlo_collectives import collectives
from ntp_jax.errors import ConfigError
from ntp_jax.model import ModelSpec
from ntp_jax.parallel.job_step import COLLECTIVE_ERRORS
from ntp_jax.parallel.plan import Plan, make_plan, micro_batch_text, reachable_failed_sets
from ntp_jax.parallel.programs import (
  UPDATE_SUFFIX,
  PlanPrograms,
  ProgramCache,
  build_class_programs,
  class_label,
  live_rows,
  logical_state,
  plan_shapes,
)
from ntp_jax.parallel.step_modes import make_job_step
from ntp_jax.parallel.steps import StepSettings
from ntp_jax.parallel.zero import ZeroSettings
from ntp_jax.processes.arrival import ProcessLost
from ntp_jax.processes.distributed import Job
from ntp_jax.resilience.events import DeviceFailure, Event
from ntp_jax.resilience.goodput import GoodputClock
from ntp_jax.state.checkpoint import CheckpointError, CheckpointShapes
from ntp_jax.state.peer import PeerSource, poison
from ntp_jax.state.placement import LogicalSource
from ntp_jax.state.sources import InitSource
from ntp_jax.state.spanning import processes_without_pieces
from ntp_jax.training.compilation import compile_counts, compile_seconds
from ntp_jax.training.config import RunConfig
from ntp_jax.training.footprint import check_split_step
from ntp_jax.training.hooks import Hook, RunServices, StepInfo
from ntp_jax.training.precompile import PlanJob, Precompiler
from ntp_jax.training.process_guard import ProcessGuard
from ntp_jax.training.recovery import Recoveries
from ntp_jax.training.run_state import RunState
from ntp_jax.training.stored_run import read_stored_run


class DatasetRows:
  """The rows ``[cursor, cursor + count)`` of the data walk, read only when sliced.

  A job step slices out the rows of the replicas whose devices this process
  drives (``programs.class_batch``); nothing else is read.
  """

  def __init__(self, dataset, cursor: int, count: int, seq_len: int):
    self.dataset, self.cursor, self.count = dataset, cursor, count
    self.shape = (count, seq_len + 1)

  def __len__(self) -> int:
    return self.count

  def __getitem__(self, rows: slice) -> np.ndarray:
    start, stop, _ = rows.indices(self.count)
    return self.dataset.sequences(self.cursor + start, stop - start)


def plan_for(config: RunConfig, model: ModelSpec, failed: frozenset[tuple[int, int]]) -> Plan:
  """The plan of ``config``'s mesh, weights, batch and policy with ``failed`` slots."""
  return make_plan(model.layouts, tp=config.mesh.tp, dp=config.mesh.dp, failed=failed,
                   slot_weights=config.ntp.slot_weights, batch_size=config.train.batch_size,
                   rebalance=config.ntp.rebalance, microbatches=config.train.microbatches)


def _chained(*lowers: Callable[[], list]) -> Callable[[], list]:
  """``PlanJob.lower`` functions run one after the other, their programs in that order."""
  return lambda: [item for lower in lowers for item in lower()]


class TrainingRun:
  """One run between its start and its end: steps, hooks, failures and repairs.

  Made of parts a test can build alone: the training state (``run_state.RunState``:
  plan, programs, step, cursor), the recovery in progress (``recovery.Recoveries``),
  the guard over the other processes (``process_guard.ProcessGuard``), the goodput
  clock, and the services hooks may use (``hooks.RunServices``).

  Args:
    config: the run's ``training.config.RunConfig``.
    model: the ``ModelSpec`` (its layouts, ``make``, ``loss`` and ``initial_source``:
      the parameters a fresh start, or a restart with no checkpoint, begins from).
    optimizer: the optax transformation.
    devices: the job's devices (slot-major per replica).
    dataset: the training data (``sequences(cursor, count)``).
    checkpoints: a ``checkpoint.Checkpoints`` or None (off).
    writer: ``metrics.MetricsWriter`` (events: start, failure, recovery, ...).
    log: one-line logger.
    failed: the failed ``(replica, slot)`` pairs at the start.
    hooks: ``hooks.Hook``s run around every step, in order.
    precompile: compile the plans one failure or repair away in the
      background (``ntp_jax.training.precompile``; ``ntp.precompile`` resolved).
    job: this process's ``distributed.Job`` (None: one process): with a heartbeat
      that offers losses to this thread, every step of a plan over several
      processes checks their arrival before its gradient sync, and a lost
      process is survived (``distributed.recoverable``: the run goes on without
      its devices) or its last completed step written (``jit_checkpoint_s``).
    zero: the sharded optimizer (``parallel.zero.ZeroSettings``; None: the optimizer
      state replicated on every replica).
  """

  def __init__(self, config: RunConfig, model: ModelSpec, *, optimizer, devices, dataset,
               checkpoints, writer, log, failed: frozenset[tuple[int, int]],
               hooks: Sequence[Hook] = (), precompile: bool = False, job: Job | None = None,
               zero: ZeroSettings | None = None):
    self.config, self.model, self.optimizer, self.zero = config, model, optimizer, zero
    self.make_plan = functools.partial(plan_for, config, model)  # failed set -> plan
    self.devices, self.dataset, self.checkpoints = devices, dataset, checkpoints
    self.writer, self.log, self.job, self.hooks = writer, log, job, list(hooks)
    self.state = RunState(frozenset(failed))
    self.guard = ProcessGuard(job, devices, log, writer.event)
    self.recoveries = Recoveries(
        writer.event, compile_seconds,
        gather=lambda step, seconds: self.guard.compile_seconds_of(step, self.state.plan,
                                                                   seconds))
    self.clock = GoodputClock()
    self.cache = ProgramCache()
    self.precompiler = None
    if precompile:
      ntp = config.ntp
      self.precompiler = Precompiler(self.cache, log, max_programs=ntp.precompile_max_programs,
                                     max_host_bytes=int(ntp.precompile_max_host_gb * 2**30))
    self.services = RunServices(clock=self.clock, save=self.save, evaluate=self._evaluate,
                                wait_for_compile_ahead=self._wait_for_compile_ahead,
                                plan=lambda: self.state.plan, done=lambda: self.state.step)
    self.ahead_of: Plan | None = None  # the plan whose neighbours are compiling ahead
    self.losses: list[float] = []
    self.records: list[dict[str, Any]] = []
    self.marks: list[dict[str, Any]] = []  # failure / repair events, for the plot
    self.moved_bytes = 0
    self.redone_steps = 0  # steps whose work was thrown away (cut inside, or run again)

  # -- building -------------------------------------------------------------------------------

  def check_event_plans(self, events: Sequence[Event]) -> None:
    """Before anything is placed: every plan the configured ``events`` lead to (in step
    order, from the failed set at the start) must be one whose checkpoints every process
    can write (``_check_every_process_holds_a_piece``), so that a run is not refused at its
    first failure, many steps in.

    Raises:
      ConfigError: naming the event and the process that would hold no piece.
    """
    if self.checkpoints is None or jax.process_count() == 1:
      return
    failed = self.state.failed
    for event in sorted(events):
      pair = frozenset({(event.replica, event.slot)})
      failed = failed | pair if event.kind == "fail" else failed - pair
      try:
        plan = self.make_plan(failed)
      except (ValueError, ConfigError):
        continue  # no live replica: the plan refuses it when the event comes
      self._check_every_process_holds_a_piece(plan, f" after the event {event.describe()}")

  def _check_every_process_holds_a_piece(self, plan: Plan, when: str = "") -> None:
    """orbax's collective save needs a piece of every array in every process.

    Raises:
      ConfigError: a process would hold none on ``plan`` (named, with the fields to set,
        and ``when`` the plan comes); the same in every process, so no process waits to
        hear of a lost peer.
    """
    # The settings build_class_programs keys its shapes by: worked out once, used again there.
    settings = StepSettings(self.optimizer, self.config.train.clip_norm,
                            self.global_tokens(plan), self.model.loss)
    shapes = plan_shapes(plan, self.model.make, self.optimizer, self.devices, self.cache,
                         settings)
    missing = processes_without_pieces(
        [(state, mesh) for (_, state), mesh in zip(shapes.targets, shapes.meshes)], plan.t_min)
    if missing:
      process, name = next(iter(missing.items()))
      raise ConfigError(
          f"checkpoint.every: process {process} would hold no piece of {name} on the plan"
          f"{when} (its TP group spans processes and it holds only late slots), which orbax's "
          f"collective save needs; set checkpoint.every=0 or "
          f"distributed.processes_per_domain=1")

  def build(self, plan: Plan, source) -> None:
    """Programs of ``plan`` filled from ``source``; the next step compiles unless every program
    was compiled before (a plan met again, or compiled ahead)."""
    state = self.state
    state.plan = plan
    if self.checkpoints is not None and jax.process_count() > 1:
      self._check_every_process_holds_a_piece(plan)  # from shapes: before anything is placed
    commits = self.guard.commits(plan)
    arrive = self.guard.arrives_before_sync(plan) and not commits
    # The sharded optimizer and steps that commit take the split halves.
    split = arrive or commits or self.zero is not None
    if split or len(plan.classes) > 1:
      check_split_step(plan, self.model, self.zero is not None)
    state.programs = build_class_programs(plan, self.model.make, self.optimizer,
                                          self.config.train.clip_norm, self.global_tokens(plan),
                                          self.devices, source=source, cache=self.cache,
                                          loss=self.model.loss, split=split)
    state.job_step = make_job_step(plan, state.programs, cache=self.cache, split=split,
                                   before_sync=self._arrive if arrive else None,
                                   zero=self.zero, commit=self._commit if commits else None)
    if state.job_step.zero is not None:
      pieces = state.job_step.zero.pieces
      self.log(f"{'  ' if state.step else ''}optimizer state: {self.zero.name}, {pieces} "
               f"piece(s) per peer group, each held by {len(plan.replicas) // pieces} replica(s) "
               f"(train.optimizer_copies={self.zero.copies})")
    compiled = self.cache.compiled_keys()
    state.compile_next = not set(state.job_step.keys) <= compiled
    if state.step:  # at start-up every program is new: say nothing
      names = [f"class program ({class_label(p.replica_class)})"
               for p in state.programs if p.key is not None]
      if state.job_step.zero_key is not None:
        names.append("sharded optimizer")
      elif state.job_step.sync_key is not None:
        names.append("cross-class sync")
      for what, key in zip(names, state.job_step.keys):
        status = "compiled already" if key in compiled else "compiles with the next step"
        self.log(f"  {what}: {status}")

  def _arrive(self, phase: str = "sync") -> None:
    self.guard.arrive(self.state.step, self.state.plan, phase)

  def _commit(self, phase: str, error: BaseException | None) -> None:
    self.guard.commit(self.state.step, self.state.plan, phase, error)

  def global_tokens(self, plan: Plan) -> int:
    """Predicted tokens in one step of ``plan``, over every class."""
    return plan.global_batch * self.config.train.seq_len

  def compile_ahead(self) -> None:
    """Schedule the background compile of every plan one failure or repair away from the
    current one (``ntp_jax.training.precompile``): its state moves, steps and sync. In a
    recoverable multi-process job, also the loss of each other process (all its devices
    failed at once)."""
    if self.precompiler is None:
      return
    state, jobs = self.state, []  # a lost process's devices stay failed: no plan brings them back
    tp, dp = state.plan.tp, state.plan.dp
    lost = self.guard.slots_of(self.guard.lost_devices, tp)
    changes = [(failed, None) for failed in reachable_failed_sets(state.failed, dp=dp, tp=tp)
               if lost <= failed]
    if self.job is not None and self.job.multi_process and self.job.recoverable:
      for process in sorted(self.guard.live_processes() - {jax.process_index()}):
        slots = self.guard.slots_of(self.guard.devices_of({process}), tp)
        if not slots <= state.failed:
          changes.append((state.failed | slots, process))
    for failed, process in changes:
      try:
        plan = self.make_plan(failed)
      except (ValueError, ConfigError):
        continue  # no live replica left: nothing to compile for
      if process is None:
        change = ", ".join(f"{'fail' if pair in failed else 'repair'} {pair[0]}:{pair[1]}"
                           for pair in sorted(failed ^ state.failed))
      else:
        change = f"lose process {process}"
      label = f"{change} -> TP degrees {[r.degree for r in plan.replicas]}"
      # The old state and the dead devices as apply will see them (bound now: the plan may
      # change before the worker gets to this job).
      dead = {self.devices[r * tp + s] for r, s in failed - state.failed}
      dead |= self.guard.lost_devices
      programs = state.programs
      if self.zero is not None:  # a sharded state moves in the class layout (class_programs)
        programs = [dataclasses.replace(p, opt_state=shape)
                    for p, shape in zip(programs, state.job_step.opt_shapes)]
      if process is not None:  # as process_lost: the old state on the live processes' rows
        dead |= self.guard.devices_of({process})
        live = self.guard.live_processes() - {process}
        programs = [p for p in (live_rows(p, live, partial=self.zero is None,
                                          shapes_only=True) for p in programs)
                    if p is not None]
      lower = functools.partial(self._programs_ahead, plan, programs, frozenset(dead))
      if process is not None and self.zero is not None:  # first the survivors' read-back
        lower = _chained(state.job_step.lower_read_back_by_survivors(programs, frozenset(dead)),
                         lower)
      jobs.append(PlanJob(failed, label, lower, origin=state.failed,
                          lost=frozenset() if process is None else frozenset({process})))
    if self.zero is not None:  # first: what gives this plan's sharded state back at a failure
      jobs.insert(0, PlanJob(state.failed, "this plan's optimizer state read back",
                             state.job_step.lower_read_back(), origin=state.failed))
    self.precompiler.schedule(jobs)

  def _programs_ahead(self, plan: Plan, programs: list, dead: frozenset) -> list:
    """The programs a move from ``programs`` (the old plan's, with ``dead`` devices failed
    or lost) onto ``plan`` and its first step run, lowered. The moves are planned as
    ``apply`` will plan them (the same old state, dead and live devices), so the programs
    are the ones it calls."""
    if self.config.ntp.recovery == "live":
      source = PeerSource(programs, set(dead), devices=self.devices,
                          cache=self.cache)
    else:  # the restart path restores a checkpoint, whichever step it holds
      source = CheckpointShapes()
    return PlanPrograms(plan, self.model.make, self.optimizer, self.config.train.clip_norm,
                        self.global_tokens(plan), self.devices, cache=self.cache,
                        loss=self.model.loss, split=self.guard.arrives_before_sync(plan),
                        zero=self.zero, commits=self.guard.commits(plan)).lower(
                            self.config.train.seq_len, source, skip=self.cache.compiled_keys())

  def _compile_before_arriving(self, plan: Plan) -> None:
    """Steps that commit bound every collective's wait (``distributed.initialize``): a peer
    still compiling a program that this process already runs would be taken for lost. So
    each process compiles the step's programs before it arrives at the step's start.

    Raises:
      ConfigError: the update, which runs after the vote, holds a collective (an optimizer
        that is not elementwise): a peer lost inside it would leave the survivors apart.
    """
    lowered = PlanPrograms(plan, self.model.make, self.optimizer, self.config.train.clip_norm,
                           self.global_tokens(plan), self.devices, cache=self.cache,
                           loss=self.model.loss, zero=self.zero, commits=True).lower(
                               self.config.train.seq_len, skip=self.cache.compiled_keys())
    for what, _, program in lowered:
      compiled = program.compile()
      found = collectives(compiled.as_text()) if what.endswith(UPDATE_SUFFIX) else []
      if found:
        raise ConfigError(f"train: the optimizer's update holds collectives "
                          f"({sorted({c.kind for c in found})}), so a recoverable step cannot "
                          "commit; use an elementwise optimizer")

  def _wait_for_compile_ahead(self, timeout_s: float | None) -> bool:
    if self.precompiler is None:
      return True
    # A loss met while a hook waits here is taken over after the wait, as after a compile
    # (the next step's end sets the allowance back).
    self.guard.step_starts(compiles=True)
    return self.precompiler.wait_idle(timeout=timeout_s)

  def fresh_source(self, plan: Plan) -> LogicalSource:
    """The state a run without a checkpoint starts from: ``initial_source`` (logged) or init."""
    if self.model.initial_source is None:
      return InitSource(lambda: self.model.make(plan.logical_layouts))
    source = self.model.initial_source()
    self.log(f"parameters: from {source.describe()}")
    return source

  def start(self, plan: Plan, source, step: int, cursor: int) -> None:
    """Programs of ``plan`` from ``source`` (a checkpoint), or fresh when it is None."""
    self.state.start_at(step, cursor)
    self.state.saved_step = step if source is not None else None
    if source is None:  # fresh parameters: part of start-up (idle time)
      self.build(plan, self.fresh_source(plan))
    else:
      with self.clock.timed("checkpoint_restore"):
        self.build(plan, source)

  # -- checkpoints and evaluation -------------------------------------------------------------

  def save(self) -> float:
    """A checkpoint of the steps done; returns the seconds the step was held (the move to
    the even layout and the copy off the devices). Where steps commit, a peer lost inside
    it is taken over and the save made again on the new plan (``_survived``)."""
    start = time.perf_counter()
    self._survived("save", self._save)
    held = time.perf_counter() - start
    self.clock.add("checkpoint_save", held)
    self.state.saved_step = self.state.step
    return held

  def _save(self) -> None:
    state = self.state
    meta = {"data_cursor": state.cursor, "plan": state.plan.summary(),
            "config": self.config.to_json_dict()}
    # A sharded optimizer state is saved in the class layout (``class_programs``).
    self.checkpoints.save(state.step, logical_state(state.job_step.class_programs(), self.cache),
                          meta)

  def _evaluate(self, rows: np.ndarray) -> float:
    return self._survived("eval", lambda: self.state.job_step.eval_loss(rows))

  def _survived(self, phase: str, work: Callable[[], Any]) -> Any:
    """``work()`` between steps (a save or an evaluation: collectives across processes that
    consume nothing), and, where steps commit, a vote on it (``phase``). A peer lost inside
    it: every survivor takes the loss over (``process_lost``: the committed state moves to
    the new plan) and runs ``work`` again there. A save's abandoned step folder is never
    listed (orbax renames it only when every process wrote its part).

    Raises:
      CheckpointError, jax.errors.JaxRuntimeError: ``work`` failed and no process was lost.
    """
    while True:
      if not self.guard.commits(self.state.plan):
        return work()
      error = value = None
      self.guard.between_steps_starts()
      try:
        value = work()
      except (*COLLECTIVE_ERRORS, CheckpointError) as err:  # a peer lost inside?
        error = err
      try:
        self.guard.commit(self.state.step, self.state.plan, phase, error)
        return value
      except ProcessLost as lost:
        self.process_lost(lost, inside=False)

  # -- failures and repairs -------------------------------------------------------------------

  def apply(self, events: list[Event], lost: frozenset[int] = frozenset()) -> None:
    """Change the failed set by ``events`` (``lost``: the processes whose loss they are)
    and move the job onto the new plan.

    The parts of the cost go to the ``recovered`` event, written after the
    first step on the new plan (``recovery.RecoveryRecord``): ``plan_s``, ``wait_s``
    (for a compile ahead of this plan still running), ``move_s``,
    ``compile_s`` (seconds this thread compiled from the failure to the end
    of that step) and ``first_step_s``.
    """
    state = self.state
    self.recoveries.finish(state.step, None)
    before = state.failed
    for event in events:
      pair = frozenset({(event.replica, event.slot)})
      state.failed = state.failed | pair if event.kind == "fail" else state.failed - pair
      self.marks.append({"step": state.step, "kind": event.kind, "label": event.describe()})
      self.writer.event(event.kind, step=state.step, replica=event.replica, slot=event.slot,
                        mid=event.mid)
    dead = {self.devices[r * state.plan.tp + s] for r, s in state.failed - before}
    start, compiled = time.perf_counter(), compile_seconds()
    plan = self.make_plan(state.failed)
    plan_s = time.perf_counter() - start
    dropped = "".join(f", replica {r} dropped (no live slot)" for r in plan.dropped)
    redo = "; step cut after its gradients, redone" if any(e.mid for e in events) else ""
    shares = ", ".join(f"{r.batch_share}" + micro_batch_text(
        r.batch_share, plan.classes[r.class_index].microbatches) for r in plan.replicas)
    self.log(f"step {state.step}: {', '.join(e.describe() for e in events)} -> TP degrees "
             f"{[r.degree for r in plan.replicas]}{dropped}, {plan.global_batch} sequences per "
             f"step (shares {shares}){redo}")
    wait_s = self.precompiler.settle(state.failed) if self.precompiler is not None else 0.0
    self.clock.add("compile", wait_s)
    ahead = self.precompiler is not None and (
        (before, state.failed, lost) in self.precompiler.ready)
    record = self.recoveries.begin(start, compiled, plan_s=plan_s, wait_s=wait_s, ahead=ahead,
                                   cut=bool(redo))
    if self.config.ntp.recovery != "live":
      self.restart(plan)
      return
    moving = time.perf_counter()
    # Without compiling ahead, the moves of a plan met before are cached: say nothing of it.
    note = ("" if self.precompiler is None else " (programs compiled ahead)" if ahead
            else " (programs not compiled ahead: compiling them now)")
    self.log(f"  moving the state from DP peers onto the new plan{note}")
    try:
      # A sharded optimizer state in the class layout, each piece from a live copy (after
      # a lost process, read back among the survivors: state.programs are their rows).
      programs = state.job_step.class_programs(dead, lost=self.guard.lost_devices,
                                               survivors=state.programs)
      poison(programs, dead)
      source = PeerSource(programs, dead | self.guard.lost_devices, devices=self.devices,
                          cache=self.cache)
      self._voted_move(lambda: self.build(plan, source))
    except LookupError as err:
      self.log(f"  live recovery impossible ({err}); restoring the last checkpoint instead")
      self.restart(plan)
      return
    move_s = time.perf_counter() - moving
    move_compile = compile_seconds() - compiled
    self.clock.add("compile", move_compile)
    self.clock.add("reconfigure", time.perf_counter() - start - wait_s - move_compile)
    self.moved_bytes += source.copied_bytes
    record.path, record.move_s, record.copied_bytes = "live", move_s, source.copied_bytes
    record.transfer_s = source.transfer_s
    record.seconds = time.perf_counter() - start
    across = ""
    if jax.process_count() > 1:
      record.crossed_bytes = source.crossed_bytes
      across = f" ({source.crossed_bytes / 1e6:.2f} MB between processes)"
    self.log(f"  live: state moved from DP peers, {source.copied_bytes / 1e6:.2f} MB copied "
             f"between devices{across}, in {move_s:.2f} s")

  def _voted_move(self, build: Callable[[], None]) -> None:
    """``build()`` (the new plan's state moved from live peers), then, where the new plan's
    steps commit, a vote that the move ended in every live process: its collectives cross
    processes, and a peer lost inside them leaves the new state unusable.

    Every live process first arrives at the move: a peer lost since the loss being taken
    over (it has not arrived when the heartbeat names it) is met there, before any of the
    move's collectives, rather than inside one (gloo waits 30 s to connect to a dead peer).

    Raises:
      ProcessLost: a peer was lost before or during the move (agreed); the old programs are
        intact (nothing of them is donated), ``process_lost`` starts again from them.
    """
    if self.guard.commits(self.state.plan):
      self._arrive("move")
    error = None
    try:
      build()
      jax.block_until_ready([(p.params, p.opt_state) for p, local
                             in zip(self.state.programs, self.state.job_step.local) if local])
    except COLLECTIVE_ERRORS as err:  # a collective of the move with a lost peer
      error = err
    if self.guard.commits(self.state.plan):
      self.guard.commit(self.state.step, self.state.plan, "move", error)
    elif error is not None:
      raise error

  def restart(self, plan: Plan) -> None:
    """The restart path: the new plan restored from the last complete checkpoint."""
    state = self.state
    start = time.perf_counter()
    if self.checkpoints is None:
      raise RuntimeError(f"recovery at step {state.step}: no live copy of the state and "
                         "checkpoint.every=0; nothing to restart from")
    self.checkpoints.wait()
    latest = self.checkpoints.latest_step()
    if latest is None:
      state.rewind(0, 0)
      source = None
    else:
      stored = read_stored_run(self.checkpoints, latest, param_shapes=False)
      if stored.data_cursor is None:  # this run wrote it: its own checkpoints carry one
        raise CheckpointError(f"checkpoint {stored.step_dir}: its metadata has no "
                              "data_cursor, so the run cannot restart from it")
      state.rewind(latest, stored.data_cursor)
      source = self.checkpoints.source(latest)
    where = self.checkpoints.step_dir(latest) if latest is not None else "initialisation"
    self.log(f"  restoring step {state.step} from {where} onto the new plan")
    self.build(plan, source or self.fresh_source(plan))
    state.saved_step = latest
    self.clock.add("checkpoint_restore", time.perf_counter() - start)
    # Redone work: the steps past the checkpoint, and the step cut inside (already thrown away).
    record = self.recoveries.pending
    cut = int(record is not None and record.cut)
    redo = state.furthest - state.step + cut
    if record is not None:
      record.path, record.move_s, record.redo = "restart", time.perf_counter() - start, redo
      record.seconds = time.perf_counter() - record.start
    self.log(f"  restart: restored step {state.step} from {where} in "
             f"{time.perf_counter() - start:.2f} s; {redo} step(s) redone"
             + (" (counting the step cut inside)" if cut else ""))

  # -- steps ----------------------------------------------------------------------------------

  def _rows(self) -> DatasetRows:
    state = self.state
    return DatasetRows(self.dataset, state.cursor, state.plan.global_batch,
                       self.config.train.seq_len)

  def discard_step(self) -> None:
    """A step cut by a failure after its gradients: computed, then thrown away."""
    with self.clock.timed("redone"):
      self.state.job_step.gradients_only(self._rows())
    self.redone_steps += 1

  def run_step(self, steps: int) -> dict[str, Any]:
    """One optimizer step of the current plan, then its hooks; returns its metrics record."""
    state = self.state
    plan, job_step = state.plan, state.job_step
    degrees = [r.degree for r in plan.replicas]
    tokens = plan.global_batch * self.config.train.seq_len
    batch = self._rows()
    if state.compile_next:
      self.log(f"  step {state.step}: compiling the programs of this plan (or loading them "
               "from the compilation cache)")
      counts = compile_counts()
    busy = self.precompiler is not None and self.precompiler.busy
    start = time.perf_counter()
    self.guard.step_starts(state.compile_next)
    if self.guard.arrives_at_start(plan):
      # The last step's loss was read from one device: its sync may still run on the others.
      # Arrive once it has ended on every local device, so that no collective across
      # processes is in flight while the peers are counted (a peer that dies then cannot
      # hold this process in one).
      jax.block_until_ready([(p.params, p.opt_state) for p, local
                             in zip(state.programs, job_step.local) if local])
      if state.compile_next and job_step.commit is not None:
        self._compile_before_arriving(plan)
      self._arrive("start")  # every process is here: none of this step's programs has run
    metrics = job_step(batch)
    # Both block: with several classes the loss is ready before the update is done.
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    elapsed = time.perf_counter() - start
    if not np.isfinite(loss):
      raise FloatingPointError(f"loss is {loss} at step {state.step}; lower train.lr")
    compiled = state.compile_next
    self.guard.step_ended(elapsed, compiled)
    redone = state.redoing
    self.redone_steps += redone
    # A step that compiles is mostly compilation, even when it is also redone work.
    bucket = "compile" if compiled else "redone" if redone else "productive"
    self.clock.add(bucket, elapsed)
    state.compile_next = False
    if not redone:
      self.clock.tokens += tokens
    record = {"step": state.step, "loss": loss, "tokens": tokens, "step_time_s": elapsed,
              "tp_degree": min(degrees), "tp_degrees": degrees,
              "grad_norm": grad_norm, "global_batch": plan.global_batch,
              "data_cursor": state.cursor + plan.global_batch, "time": time.time()}
    if compiled:
      record["compiled"] = True  # new to this process: compiled, or loaded from the cache
      # Which: a restart should load every program the previous session compiled.
      (fresh, loaded), (fresh_before, loaded_before) = compile_counts(), counts
      record["programs_compiled"] = fresh - fresh_before
      record["programs_loaded"] = loaded - loaded_before
      self.log(f"  step {state.step}: {record['programs_compiled']} program(s) compiled, "
               f"{record['programs_loaded']} loaded from the compilation cache")
      self.cache.mark_compiled(job_step.keys)
    if busy:
      record["precompiling"] = True  # a background compile shared the machine
    state.advance(plan.global_batch)
    self.losses.append(loss)
    self.records.append(record)
    self.recoveries.finish(record["step"], elapsed)
    lost = job_step.take_pending_loss()
    if lost is not None:  # after the step's update committed: the step counts
      self.process_lost(lost, inside=False)
    if self.ahead_of is not plan:  # after a plan's first step: it has the machine first
      self.ahead_of = plan
      self.compile_ahead()
    info = StepInfo(step=record["step"], done=state.step, total=steps, plan=plan, loss=loss,
                    grad_norm=grad_norm, tokens=tokens, step_time_s=elapsed,
                    compiled=compiled, record=record, services=self.services)
    for hook in self.hooks:
      if hook.due(info):
        hook.on_step(info)
    return record

  # -- lost processes -------------------------------------------------------------------------

  def process_lost(self, lost: ProcessLost, inside: bool = True) -> None:
    """Processes lost (agreed by every survivor): go on without their devices
    (``distributed.recoverable``). ``inside``: met inside this step (it is thrown away and
    redone), else between steps (in a save or an evaluation after the step before).

    Raises:
      process_guard.ProcessStop: not recoverable; the last completed step was written as a
        just-in-time checkpoint where possible.
    """
    state = self.state
    if not self.job.recoverable:
      raise self.guard.stop(lost, state.just_in_time(self.config.to_json_dict()),
                            self.checkpoints)
    events = self.guard.take_loss(lost, state.step, state.plan.tp, state.failed, inside)
    self.guard.recovery_starts()
    live = self.guard.live_processes()
    if self.checkpoints is not None:
      self.checkpoints.restrict(live)
    # The old state on the replicas with a live process (a sharded optimizer state: whole
    # replicas only); the move reads no lost device.
    old = state.plan, state.programs, state.job_step
    state.programs = [p for p in (live_rows(p, live, partial=self.zero is None)
                                  for p in state.programs) if p is not None]
    try:
      self.apply(events, lost.processes)
    except ProcessLost as again:  # another peer lost while the state moved: from the old state
      state.plan, state.programs, state.job_step = old
      if self.recoveries.pending is not None:
        self.recoveries.pending.path = "interrupted"
      self.log(f"step {state.step}: {again.message}; the move is started again")
      self.process_lost(again, inside)

  def events_before(self, step: int) -> list[Event]:
    """What the hooks report before ``step``: their events, and a ``DeviceFailure`` one
    raises as a failure between steps."""
    events = []
    for hook in self.hooks:
      try:
        events += list(hook.before_step(step, self.services))
      except DeviceFailure as failure:  # found before the step: a failure between steps
        events.append(Event(step, False, "fail", failure.replica, failure.slot))
    return events

  def train(self, steps: int, events: Sequence[Event], stop) -> None:
    """Steps until ``steps`` or a stop signal, applying ``events`` (and those the hooks
    report, ``Hook.before_step``) at their steps; then every hook's ``on_end``.

    A ``events.DeviceFailure`` raised by a step is handled as a failure inside that step.

    Raises:
      process_guard.ProcessStop: a lost process ends this one (not recoverable).
    """
    state = self.state
    pending = sorted(events)
    try:
      while state.step < steps and not stop.due(state.step):
        due = [e for e in pending if e.step == state.step] + self.events_before(state.step)
        between = [e for e in due if not e.mid]
        if between:
          self.apply(between)
        inside = [e for e in due if e.mid]
        if inside:
          self.discard_step()
          self.apply(inside)
        pending = [e for e in pending if e not in due]
        attempt = time.perf_counter()
        try:
          self.run_step(steps)
        except DeviceFailure as failure:
          self.apply([Event(state.step, True, "fail", failure.replica, failure.slot)])
        except ProcessLost as lost:
          # The step's gradients are thrown away: its update never ran.
          self.clock.add("redone", time.perf_counter() - attempt)
          self.redone_steps += 1
          state.compile_next = False
          self.process_lost(lost)
    finally:
      self.recoveries.finish(state.step, None)
      if self.precompiler is not None:
        self.precompiler.close()
      for hook in self.hooks:
        hook.on_end(self.services)
