"""One training run: steps, checkpoints, failures and repairs while it runs, goodput.

``trainer.train`` sets up the config, plan and data and hands over to
``TrainingRun``. Events (``events.Event``) change the set of failed slots
before a step (or inside it, ``mid``); the run then re-plans and moves the
live state onto the new plan (``ntp.recovery="live"``: from DP peers, see
``ntp_jax.state.peer``) or restores the last checkpoint onto it
(``"restart"``, and the fallback when no live copy exists).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ntp_jax.errors import ConfigError
from ntp_jax.parallel.distributed import Job
from ntp_jax.parallel.job_step import JobStep
from ntp_jax.parallel.plan import Plan, micro_batch_text, reachable_failed_sets
from ntp_jax.parallel.programs import (
  PlanPrograms,
  ProgramCache,
  build_class_programs,
  class_label,
  live_rows,
  logical_state,
  plan_shapes,
)
from ntp_jax.parallel.steps import StepSettings, default_loss
from ntp_jax.resilience.arrival import Arrival, ProcessLost
from ntp_jax.resilience.events import DeviceFailure, Event
from ntp_jax.resilience.goodput import GoodputClock
from ntp_jax.sharding.topology import processes_of
from ntp_jax.state.checkpoint import CheckpointShapes
from ntp_jax.state.peer import PeerSource, poison
from ntp_jax.state.placement import LogicalSource
from ntp_jax.state.sources import InitSource
from ntp_jax.state.spanning import processes_without_pieces
from ntp_jax.train.compilation import compile_seconds
from ntp_jax.train.config import RunConfig
from ntp_jax.train.hooks import Hook, StepInfo
from ntp_jax.train.just_in_time import write_just_in_time
from ntp_jax.train.precompile import PlanJob, Precompiler

# Seconds the heartbeat waits for the main thread to take a loss over while a step
# compiles (a large model's first step compiles for minutes); else a few steps' time.
COMPILE_TAKEOVER_S = 900.0


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


class TrainingRun:
  """State of a run between steps: plan, programs, step, data cursor, failed slots.

  Args:
    config: the run's ``train.config.RunConfig``.
    make_plan: ``failed (replica, slot) pairs -> Plan``.
    make_model: ``layouts -> module``. loss: ``ModelSpec.loss``.
    optimizer: the optax transformation.
    devices: the job's devices (slot-major per replica).
    dataset: the training data (``sequences(cursor, count)``).
    checkpoints: a ``checkpoint.Checkpoints`` or None (off).
    writer: ``metrics.MetricsWriter`` (events: start, failure, recovery, ...).
    log: one-line logger.
    failed: the failed ``(replica, slot)`` pairs at the start.
    hooks: ``hooks.Hook``s run around every step, in order.
    initial_source: ``ModelSpec.initial_source``: the parameters a fresh
      start, or a restart with no checkpoint, begins from; None: the
      model's own initialisation (``InitSource``).
    precompile: compile the plans one failure or repair away in the
      background (``ntp_jax.train.precompile``; ``ntp.precompile`` resolved).
    job: this process's ``distributed.Job`` (None: one process): with a heartbeat
      that offers losses to this thread, every step of a plan over several
      processes checks their arrival before its gradient sync, and a lost
      process is survived (``distributed.recoverable``: the run goes on without
      its devices) or its last completed step written (``jit_checkpoint_s``).
  """

  def __init__(self, config: RunConfig, *, make_plan: Callable[[frozenset], Plan], make_model,
               optimizer, devices, dataset, checkpoints, writer, log,
               failed: frozenset[tuple[int, int]], loss=default_loss,
               hooks: Sequence[Hook] = (),
               initial_source: Callable[[], LogicalSource] | None = None,
               precompile: bool = False, job: Job | None = None):
    self.config = config
    self.job = job
    self.arrival = None
    if job is not None and job.multi_process and job.heartbeat is not None and (
        job.heartbeat.takeover_s is not None):
      self.arrival = Arrival(job.client, job.process_id, job.heartbeat)
      self.takeover_base_s = job.heartbeat.takeover_s
    self.initial_source = initial_source
    self.loss = loss
    self.hooks = list(hooks)
    self.make_plan = make_plan
    self.make_model = make_model
    self.optimizer = optimizer
    self.devices = devices
    self.dataset = dataset
    self.checkpoints = checkpoints
    self.writer = writer
    self.log = log
    self.failed = frozenset(failed)
    self.cache = ProgramCache()
    self.precompiler = None
    if precompile:
      ntp = config.ntp
      self.precompiler = Precompiler(self.cache, log, max_programs=ntp.precompile_max_programs,
                                     max_host_bytes=int(ntp.precompile_max_host_gb * 2**30))
    self.recovery: dict[str, Any] | None = None  # the last recovery, until its first step
    self.ahead_of: Plan | None = None  # the plan whose neighbours are compiling ahead
    self.clock = GoodputClock()
    self.plan: Plan | None = None
    self.programs: list = []
    self.job_step: JobStep | None = None
    self.step = 0
    self.cursor = 0
    self.saved_step: int | None = None
    self.furthest = 0  # steps done at most so far: below it, a step is redone work
    self.compile_next = True
    self.losses: list[float] = []
    self.records: list[dict[str, Any]] = []
    self.marks: list[dict[str, Any]] = []  # failure / repair events, for the plot
    self.moved_bytes = 0
    self.lost_devices: set = set()  # devices of processes lost (recoverable mode)
    self.redone_steps = 0  # steps whose work was thrown away (cut inside, or run again)

  # -- building -------------------------------------------------------------------------------

  def _check_every_process_holds_a_piece(self, plan: Plan) -> None:
    """orbax's collective save needs a piece of every array in every process.

    Raises:
      ConfigError: a process would hold none on ``plan`` (named, with the fields to set);
        the same in every process, so no process waits to hear of a lost peer.
    """
    # The settings build_class_programs keys its shapes by: worked out once, used again there.
    settings = StepSettings(self.optimizer, self.config.train.clip_norm,
                            self.global_tokens(plan), self.loss)
    shapes = plan_shapes(plan, self.make_model, self.optimizer, self.devices, self.cache,
                         settings)
    missing = processes_without_pieces(
        [(state, mesh) for (_, state), mesh in zip(shapes.targets, shapes.meshes)], plan.t_min)
    if missing:
      process, name = next(iter(missing.items()))
      raise ConfigError(
          f"checkpoint.every: process {process} would hold no piece of {name} on this plan "
          f"(its TP group spans processes and it holds only late slots), which orbax's "
          f"collective save needs; set checkpoint.every=0 or "
          f"distributed.processes_per_domain=1")

  def build(self, plan: Plan, source) -> None:
    """Programs of ``plan`` filled from ``source``; the next step compiles unless every program
    was compiled before (a plan met again, or compiled ahead)."""
    self.plan = plan
    if self.checkpoints is not None and jax.process_count() > 1:
      self._check_every_process_holds_a_piece(plan)  # from shapes: before anything is placed
    split = self.guarded(plan)
    self.programs = build_class_programs(plan, self.make_model, self.optimizer,
                                         self.config.train.clip_norm, self.global_tokens(plan),
                                         self.devices, source=source, cache=self.cache,
                                         loss=self.loss, split=split)
    self.job_step = JobStep(plan, self.programs, cache=self.cache, split=split,
                            before_sync=self._arrive if split else None)
    compiled = self.cache.compiled_keys()
    self.compile_next = not set(self.job_step.keys) <= compiled
    if self.step:  # at start-up every program is new: say nothing
      names = [f"class program ({class_label(p.replica_class)})"
               for p in self.programs if p.key is not None]
      names += ["cross-class sync"] if self.job_step.sync_key is not None else []
      for what, key in zip(names, self.job_step.keys):
        state = "compiled already" if key in compiled else "compiles with the next step"
        self.log(f"  {what}: {state}")

  def plan_processes(self, plan: Plan) -> set[int]:
    """The processes whose devices the plan's live replicas use."""
    return processes_of(self.devices[r.replica * plan.tp + s]
                        for r in plan.replicas for s in r.live_slots)

  def guarded(self, plan: Plan) -> bool:
    """Steps of ``plan`` check every process's arrival before their sync: a plan over
    several processes whose every TP group lies in one (else the gradients themselves
    cross processes, and a lost process holds the others in them)."""
    if self.arrival is None or len(self.plan_processes(plan)) < 2:
      return False
    return all(len(processes_of(self.devices[r.replica * plan.tp + s] for s in r.live_slots)) == 1
               for r in plan.replicas)

  def _arrive(self, phase: str = "sync") -> None:
    self.arrival.wait(self.step, self.plan_processes(self.plan) - self.lost_processes, phase)

  @property
  def lost_processes(self) -> set[int]:
    return {d.process_index for d in self.lost_devices}

  def global_tokens(self, plan: Plan) -> int:
    """Predicted tokens in one step of ``plan``, over every class."""
    return plan.global_batch * self.config.train.seq_len

  def compile_ahead(self) -> None:
    """Schedule the background compile of every plan one failure or repair away from the
    current one (``ntp_jax.train.precompile``): its state moves, steps and sync."""
    if self.precompiler is None:
      return
    jobs = []  # a lost process's devices stay failed: no plan brings them back
    lost = {(i // self.plan.tp, i % self.plan.tp) for i, d in enumerate(self.devices)
            if d in self.lost_devices}
    tp, dp = self.plan.tp, self.plan.dp
    for failed in reachable_failed_sets(self.failed, dp=dp, tp=tp):
      if not lost <= failed:
        continue
      try:
        plan = self.make_plan(failed)
      except (ValueError, ConfigError):
        continue  # no live replica left: nothing to compile for
      dead = {self.devices[r * tp + s] for r, s in failed - self.failed}
      change = ", ".join(f"{'fail' if pair in failed else 'repair'} {pair[0]}:{pair[1]}"
                         for pair in sorted(failed ^ self.failed))
      label = f"{change} -> TP degrees {[r.degree for r in plan.replicas]}"
      jobs.append(PlanJob(failed, label, functools.partial(
          self._programs_ahead, plan, self.programs, dead), origin=self.failed))
    self.precompiler.schedule(jobs)

  def _programs_ahead(self, plan: Plan, programs: list, dead: set) -> list:
    """The programs a move from ``programs`` onto ``plan`` and its first step run, lowered."""
    if jax.process_count() > 1:  # the moves across processes are made by the recovery
      source = None
    elif self.config.ntp.recovery == "live":
      source = PeerSource(programs, dead, min_degree=plan.t_min, cache=self.cache)
    else:  # the restart path restores a checkpoint, whichever step it holds
      source = CheckpointShapes()
    return PlanPrograms(plan, self.make_model, self.optimizer, self.config.train.clip_norm,
                        self.global_tokens(plan), self.devices, cache=self.cache, loss=self.loss,
                        split=self.guarded(plan)).lower(self.config.train.seq_len, source,
                                                        skip=self.cache.compiled_keys())

  def fresh_source(self, plan: Plan) -> LogicalSource:
    """The state a run without a checkpoint starts from: ``initial_source`` (logged) or init."""
    if self.initial_source is None:
      return InitSource(lambda: self.make_model(plan.logical_layouts))
    source = self.initial_source()
    self.log(f"parameters: from {source.describe()}")
    return source

  def start(self, plan: Plan, source, step: int, cursor: int) -> None:
    """Programs of ``plan`` from ``source`` (a checkpoint), or fresh when it is None."""
    self.step, self.cursor, self.furthest = step, cursor, step
    self.saved_step = step if source is not None else None
    if source is None:  # fresh parameters: part of start-up (idle time)
      self.build(plan, self.fresh_source(plan))
    else:
      with self.clock.timed("checkpoint_restore"):
        self.build(plan, source)

  # -- checkpoints ----------------------------------------------------------------------------

  def save(self) -> float:
    meta = {"data_cursor": self.cursor, "plan": self.plan.summary(),
            "config": self.config.to_json_dict()}
    start = time.perf_counter()  # the hold: the move to the even layout and the copy off
    self.checkpoints.save(self.step, logical_state(self.programs, self.cache), meta)
    held = time.perf_counter() - start
    self.clock.add("checkpoint_save", held)
    self.saved_step = self.step
    return held

  # -- failures and repairs -------------------------------------------------------------------

  def apply(self, events: list[Event]) -> None:
    """Change the failed set by ``events`` and move the job onto the new plan.

    The parts of the cost go to the ``recovered`` event, written after the
    first step on the new plan (``finish_recovery``): ``plan_s``, ``wait_s``
    (for a compile ahead of this plan still running), ``move_s``,
    ``compile_s`` (seconds this thread compiled from the failure to the end
    of that step) and ``first_step_s``.
    """
    self.finish_recovery(None)
    before = self.failed
    for event in events:
      pair = frozenset({(event.replica, event.slot)})
      self.failed = self.failed | pair if event.kind == "fail" else self.failed - pair
      self.marks.append({"step": self.step, "kind": event.kind, "label": event.describe()})
      self.writer.event(event.kind, step=self.step, replica=event.replica, slot=event.slot,
                        mid=event.mid)
    dead = {self.devices[r * self.plan.tp + s] for r, s in self.failed - before}
    start, compiled = time.perf_counter(), compile_seconds()
    plan = self.make_plan(self.failed)
    plan_s = time.perf_counter() - start
    dropped = "".join(f", replica {r} dropped (no live slot)" for r in plan.dropped)
    redo = "; step cut after its gradients, redone" if any(e.mid for e in events) else ""
    shares = ", ".join(f"{r.batch_share}" + micro_batch_text(
        r.batch_share, plan.classes[r.class_index].microbatches) for r in plan.replicas)
    self.log(f"step {self.step}: {', '.join(e.describe() for e in events)} -> TP degrees "
             f"{[r.degree for r in plan.replicas]}{dropped}, {plan.global_batch} sequences per "
             f"step (shares {shares}){redo}")
    wait_s = self.precompiler.settle(self.failed) if self.precompiler is not None else 0.0
    self.clock.add("compile", wait_s)
    ahead = self.precompiler is not None and (before, self.failed) in self.precompiler.ready
    self.recovery = {"start": start, "compiled": compiled, "plan_s": plan_s, "wait_s": wait_s,
                     "ahead": ahead, "cut": bool(redo)}
    live = self.config.ntp.recovery == "live"
    if live:
      moving = time.perf_counter()
      # Without compiling ahead, the moves of a plan met before are cached: say nothing of it.
      state = ("" if self.precompiler is None else " (programs compiled ahead)" if ahead
               else " (programs not compiled ahead: compiling them now)")
      self.log(f"  moving the state from DP peers onto the new plan{state}")
      poison(self.programs, dead)
      source = PeerSource(self.programs, dead | self.lost_devices, min_degree=plan.t_min,
                          devices=self.devices, cache=self.cache)
      try:
        self.build(plan, source)
      except LookupError as err:
        self.log(f"  live recovery impossible ({err}); restoring the last checkpoint instead")
        self.restart(plan)
        return
      move_s = time.perf_counter() - moving
      move_compile = compile_seconds() - compiled
      self.clock.add("compile", move_compile)
      self.clock.add("reconfigure", time.perf_counter() - start - wait_s - move_compile)
      self.moved_bytes += source.copied_bytes
      self.recovery.update(path="live", move_s=move_s, copied_bytes=source.copied_bytes,
                           seconds=time.perf_counter() - start)
      if jax.process_count() > 1:
        self.recovery["crossed_bytes"] = source.crossed_bytes
      across = (f" ({source.crossed_bytes / 1e6:.2f} MB between processes)"
                if jax.process_count() > 1 else "")
      self.log(f"  live: state moved from DP peers, {source.copied_bytes / 1e6:.2f} MB copied "
               f"between devices{across}, in {move_s:.2f} s")
    else:
      self.restart(plan)

  def restart(self, plan: Plan) -> None:
    """The restart path: the new plan restored from the last complete checkpoint."""
    start = time.perf_counter()
    if self.checkpoints is None:
      raise RuntimeError(f"recovery at step {self.step}: no live copy of the state and "
                         "checkpoint.every=0; nothing to restart from")
    self.checkpoints.wait()
    latest = self.checkpoints.latest_step()
    if latest is None:
      self.step, self.cursor, source = 0, 0, None
    else:
      meta = self.checkpoints.meta(latest)
      self.step, self.cursor = latest, int(meta["data_cursor"])
      source = self.checkpoints.source(latest)
    where = self.checkpoints.step_dir(latest) if latest is not None else "initialisation"
    self.log(f"  restoring step {self.step} from {where} onto the new plan")
    self.build(plan, source or self.fresh_source(plan))
    self.saved_step = latest
    self.clock.add("checkpoint_restore", time.perf_counter() - start)
    # Redone work: the steps past the checkpoint, and the step cut inside (already thrown away).
    cut = int(self.recovery is not None and self.recovery.get("cut", False))
    redo = self.furthest - self.step + cut
    if self.recovery is not None:
      self.recovery.update(path="restart", move_s=time.perf_counter() - start, redo=redo,
                           seconds=time.perf_counter() - self.recovery["start"])
    self.log(f"  restart: restored step {self.step} from {where} in "
             f"{time.perf_counter() - start:.2f} s; {redo} step(s) redone"
             + (" (counting the step cut inside)" if cut else ""))

  def finish_recovery(self, first_step_s: float | None) -> None:
    """Write the last recovery's ``recovered`` event, once its first step has run (or
    ``first_step_s=None``: none will); see ``apply``."""
    if self.recovery is None:
      return
    r, self.recovery = self.recovery, None
    fields = {k: r[k] for k in ("path", "seconds", "plan_s", "wait_s", "move_s", "copied_bytes",
                                "crossed_bytes", "redo") if k in r}
    fields["compile_s"] = round(compile_seconds() - r["compiled"], 3)
    fields["compiled_ahead"] = r["ahead"]
    if first_step_s is not None:
      fields["first_step_s"] = first_step_s
    self.writer.event("recovered", step=self.step - (first_step_s is not None), **fields)

  # -- steps ----------------------------------------------------------------------------------

  def discard_step(self) -> None:
    """A step cut by a failure after its gradients: computed, then thrown away."""
    batch = DatasetRows(self.dataset, self.cursor, self.plan.global_batch,
                        self.config.train.seq_len)
    with self.clock.timed("redone"):
      self.job_step.gradients_only(batch)
    self.redone_steps += 1

  def run_step(self, steps: int) -> dict[str, Any]:
    """One optimizer step of the current plan, then its hooks; returns its metrics record."""
    plan = self.plan
    degrees = [r.degree for r in plan.replicas]
    tokens = plan.global_batch * self.config.train.seq_len
    batch = DatasetRows(self.dataset, self.cursor, plan.global_batch, self.config.train.seq_len)
    if self.compile_next:
      self.log(f"  step {self.step}: compiling the programs of this plan")
    busy = self.precompiler is not None and self.precompiler.busy
    start = time.perf_counter()
    if self.arrival is not None and self.compile_next:
      # A loss found while this step compiles is taken over once it has: allow for that.
      self.job.heartbeat.takeover_s = max(self.takeover_base_s, COMPILE_TAKEOVER_S)
    if self.job_step.before_sync is not None:
      # The last step's loss was read from one device: its sync may still run on the others.
      # Arrive once it has ended on every local device, so that no collective across
      # processes is in flight while the peers are counted (a peer that dies then cannot
      # hold this process in one).
      jax.block_until_ready([(p.params, p.opt_state) for p, local
                             in zip(self.programs, self.job_step.local) if local])
      self._arrive("start")  # every process is here: none of this step's programs has run
    metrics = self.job_step(batch)
    # Both block: with several classes the loss is ready before the update is done.
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    elapsed = time.perf_counter() - start
    if not np.isfinite(loss):
      raise FloatingPointError(f"loss is {loss} at step {self.step}; lower train.lr")
    if self.arrival is not None:
      # A loss found mid-step is taken over at the next arrival: allow a few steps' time
      # (a step that compiled says nothing of the next one's).
      self.job.heartbeat.takeover_s = max(self.takeover_base_s,
                                          0.0 if self.compile_next else 3 * elapsed)
    redone = self.step < self.furthest
    self.redone_steps += redone
    # A step that compiles is mostly compilation, even when it is also redone work.
    compiled = self.compile_next
    bucket = "compile" if compiled else "redone" if redone else "productive"
    self.clock.add(bucket, elapsed)
    self.compile_next = False
    if not redone:
      self.clock.tokens += tokens
    self.cursor += plan.global_batch
    record = {"step": self.step, "loss": loss, "tokens": tokens, "step_time_s": elapsed,
              "tp_degree": min(degrees), "tp_degrees": degrees,
              "grad_norm": grad_norm, "global_batch": plan.global_batch,
              "data_cursor": self.cursor, "time": time.time()}
    if compiled:
      record["compiled"] = True
      self.cache.mark_compiled(self.job_step.keys)
    if busy:
      record["precompiling"] = True  # a background compile shared the machine
    self.step += 1
    self.furthest = max(self.furthest, self.step)
    self.losses.append(loss)
    self.records.append(record)
    self.finish_recovery(elapsed)
    if self.ahead_of is not self.plan:  # after a plan's first step: it has the machine first
      self.ahead_of = self.plan
      self.compile_ahead()
    info = StepInfo(step=record["step"], done=self.step, total=steps, plan=plan, loss=loss,
                    grad_norm=grad_norm, tokens=tokens, step_time_s=elapsed,
                    compiled=compiled, record=record, run=self)
    for hook in self.hooks:
      if hook.due(info):
        hook.on_step(info)
    return record

  # -- lost processes -------------------------------------------------------------------------

  def process_lost(self, lost: ProcessLost) -> None:
    """Processes lost before this step's sync: go on without their devices
    (``distributed.recoverable``), else write the last completed step and stop."""
    if not self.job.recoverable:
      write_just_in_time(self, lost)  # ends the process
    gone = {d for d in self.devices if d.process_index in lost.processes}
    self.lost_devices |= gone
    tp = self.plan.tp
    events = [Event(self.step, True, "fail", i // tp, i % tp) for i, d in enumerate(self.devices)
              if d in gone and (i // tp, i % tp) not in self.failed]
    self.log(f"step {self.step}: {lost.message}; process {self.job.process_id} goes on without "
             f"it (distributed.recoverable): {len(gone)} device(s) fail")
    self.writer.event("process_lost", step=self.step, processes=sorted(lost.processes))
    self.arrival.epoch += 1
    if self.checkpoints is not None:
      self.checkpoints.restrict(self.live_processes())
    # The old state on the live processes' replicas only: no move touches a lost process.
    self.programs = [p for p in (live_rows(p, self.live_processes()) for p in self.programs)
                     if p is not None]
    self.apply(events)

  def live_processes(self) -> set[int]:
    return set(range(self.job.num_processes)) - self.lost_processes

  def events_before(self, step: int) -> list[Event]:
    """What the hooks report before ``step``: their events, and a ``DeviceFailure`` one
    raises as a failure between steps."""
    events = []
    for hook in self.hooks:
      try:
        events += list(hook.before_step(self, step))
      except DeviceFailure as failure:  # found before the step: a failure between steps
        events.append(Event(step, False, "fail", failure.replica, failure.slot))
    return events

  def train(self, steps: int, events: Sequence[Event], stop) -> None:
    """Steps until ``steps`` or a stop signal, applying ``events`` (and those the hooks
    report, ``Hook.before_step``) at their steps; then every hook's ``on_end``.

    A ``events.DeviceFailure`` raised by a step is handled as a failure inside that step.
    """
    pending = sorted(events)
    try:
      while self.step < steps and not stop.due(self.step):
        due = [e for e in pending if e.step == self.step] + self.events_before(self.step)
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
          self.apply([Event(self.step, True, "fail", failure.replica, failure.slot)])
        except ProcessLost as lost:
          # The step's gradients are thrown away: its update never ran.
          self.clock.add("redone", time.perf_counter() - attempt)
          self.redone_steps += 1
          self.compile_next = False
          self.process_lost(lost)
    finally:
      self.finish_recovery(None)
      if self.precompiler is not None:
        self.precompiler.close()
      for hook in self.hooks:
        hook.on_end(self)
