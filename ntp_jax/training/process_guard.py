"""This process's watch over the others of a multi-process job, between steps.

In a plan over several processes every step waits for every process to arrive
before its first program (``processes.arrival``), so a peer lost between
steps is met outside any collective: in a TP group that spans processes (one
process per GPU) as in a replica that lies in one. A plan whose every TP
group lies in one process also waits before its gradient sync, so a peer lost
during the step's gradients is met there too. The guard then either turns
the loss into failure events for the run to apply (``distributed.recoverable``:
a replica that lost some of its slots trains on at a reduced TP degree, one
that lost them all is dropped) or writes the last completed step as a
just-in-time checkpoint (``training.just_in_time``) and raises ``ProcessStop``
with the exit status for ``train.py``. It never ends the process itself;
only a watching thread does, when the main thread is held in a collective
with the lost peer and cannot return (``heartbeat.end_process``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence

import jax

from ntp_jax.parallel.plan import Plan
from ntp_jax.processes.arrival import Arrival, ProcessLost
from ntp_jax.processes.commit import FAIL, LOST, OK, StepVote, committed
from ntp_jax.processes.distributed import Job
from ntp_jax.processes.heartbeat import LOST_EXIT_CODE, end_process
from ntp_jax.resilience.events import Event
from ntp_jax.sharding.topology import processes_of
from ntp_jax.training.just_in_time import JustInTimeState, write_just_in_time

# Seconds the heartbeat waits for the main thread to take a loss over while a step
# compiles (a large model's first step compiles for minutes); else a few steps' time.
COMPILE_TAKEOVER_S = 900.0
# Seconds a stopping process gets to reach its end after a ProcessStop.
STOP_GRACE_S = 30.0
# Phases voted on outside a step's own: where a loss was met, and what the survivors do.
_PHASES = {
    "move": ("while the state moved onto the plan of step {step} (move phase",
             "the move starts again from the old state"),
    "save": ("while saving the checkpoint of step {step} (save phase",
             "the save is made again on the new plan"),
    "eval": ("while evaluating at step {step} (eval phase",
             "the evaluation runs again on the new plan"),
    # The sharded optimizer's phases after its update committed (``job_step``).
    "gather": ("inside step {step} after its update (gather phase",
               "the update stands, the parameters are rebuilt from the optimizer's pieces"),
    "unpack": ("inside step {step} after its update (unpack phase",
               "the update stands, the parameters are rebuilt from the optimizer's pieces"),
}


class ProcessStop(Exception):
  """This process must stop: a peer was lost and the run cannot go on here.

  ``train.py`` prints ``error: <message>`` and ends the process with ``status``
  (``os._exit``: orbax's and JAX's threads would wait for the lost peer at a
  normal exit). A Python caller of ``train`` should do the same.

  Attributes:
    status: the exit status (``heartbeat.LOST_EXIT_CODE``).
    message: one line naming the lost process and what was written.
  """

  def __init__(self, message: str, status: int = LOST_EXIT_CODE):
    super().__init__(message)
    self.message, self.status = message, status


class ProcessGuard:
  """Arrival checks, loss take-over and lost devices of one process in a multi-process job.

  Args:
    job: this process's ``distributed.Job``; its heartbeat must offer losses to the main
      thread (``takeover_s`` set), else no step waits for the others.
    devices: the job's devices, slot-major per replica (``trainer.check_devices``).
    log: one-line logger. event: ``(kind, **fields)`` (``metrics.MetricsWriter.event``).
  """

  def __init__(self, job: Job | None, devices: Sequence[jax.Device],
               log: Callable[..., None], event: Callable[..., None]):
    self.job, self.devices, self.log, self.event = job, list(devices), log, event
    self.arrival: Arrival | None = None
    self.vote: StepVote | None = None
    self.takeover_base_s = 0.0
    if job is not None and job.multi_process and job.heartbeat is not None and (
        job.heartbeat.takeover_s is not None):
      self.arrival = Arrival(job.client, job.process_id, job.heartbeat)
      self.vote = StepVote(job.client, job.process_id, job.heartbeat)
      self.takeover_base_s = job.heartbeat.takeover_s
    self.lost_devices: set[jax.Device] = set()  # devices of processes lost (recoverable mode)

  @property
  def lost_processes(self) -> set[int]:
    return {d.process_index for d in self.lost_devices}

  def live_processes(self) -> set[int]:
    return set(range(self.job.num_processes)) - self.lost_processes

  def plan_processes(self, plan: Plan) -> set[int]:
    """The processes whose devices the plan's live replicas use."""
    return processes_of(self.devices[r.replica * plan.tp + s]
                        for r in plan.replicas for s in r.live_slots)

  def arrives_at_start(self, plan: Plan) -> bool:
    """Steps of ``plan`` wait for every process before their first program: a plan over
    several processes, with losses offered to this thread."""
    return self.arrival is not None and len(self.plan_processes(plan)) > 1

  def arrives_before_sync(self, plan: Plan) -> bool:
    """Steps of ``plan`` also wait before their gradient sync (its gradient and update
    halves apart): when every TP group lies in one process (else the gradients themselves
    cross processes, and a peer lost inside them holds the others there)."""
    if not self.arrives_at_start(plan):
      return False
    return all(len(processes_of(self.devices[r.replica * plan.tp + s] for s in r.live_slots)) == 1
               for r in plan.replicas)

  def commits(self, plan: Plan) -> bool:
    """Steps of ``plan`` commit (``processes.commit``): a recoverable job's plan over several
    processes. A peer lost at any moment of such a step, inside its collectives included,
    leaves every survivor the state of the last step that committed."""
    return self.arrives_at_start(plan) and self.job.recoverable

  def commit(self, step: int, plan: Plan, phase: str,
             error: BaseException | None = None) -> None:
    """Vote on ``phase`` of ``step`` once its collectives ended here (``error``: what one
    raised) and return when it ended so in every live process of ``plan``.

    Raises:
      ProcessLost: it does not (a peer lost before its vote, or a peer's collective
        raised); the processes lost in it, agreed by every survivor. Nothing was applied.
      ProcessStop: the peers took this process for lost (it voted too late).
      BaseException: ``error`` (or a RuntimeError) when no process was lost: the step
        failed for another reason.
    """
    participants = self.plan_processes(plan) - self.lost_processes
    epoch, me = self.arrival.epoch, self.job.process_id
    votes = self.vote.decide(epoch, f"{step}/{phase}", participants, ok=error is None)
    if committed(votes):
      return
    heartbeat = self.job.heartbeat
    lost = frozenset({me}) if votes[me] == LOST else self.vote.agree_lost(
        epoch, f"{step}/{phase}", participants, votes,
        wait_s=heartbeat.timeout_s + 2 * heartbeat.interval_s)
    if me in lost:  # it voted too late, or a peer's heartbeat lost it first
      raise ProcessStop(f"process {me} was taken for lost by its peers inside step {step} "
                        "(no heartbeat in time) and stops; they go on without it")
    if not lost:
      if error is not None:
        raise error
      raise RuntimeError(f"step {step}: a collective raised on process(es) "
                         f"{sorted(p for p, v in votes.items() if v != OK)}, and no process "
                         "was lost")
    heartbeat.lost_processes.update(lost)  # agreed: the heartbeat stops counting them down
    heartbeat.take_over()
    raised = sorted(p for p, v in votes.items() if v == FAIL)
    where, then = _PHASES.get(phase, (f"inside step {{step}} ({phase} phase",
                                      "the step is thrown away by every survivor"))
    raise ProcessLost(lost, step, (
        f"lost process{'es' if len(lost) > 1 else ''} {', '.join(map(str, sorted(lost)))} of "
        f"{self.job.num_processes} {where.format(step=step)}; its collectives "
        f"raised on process(es) {raised}; distributed.heartbeat_timeout_s="
        f"{heartbeat.timeout_s:g}); {then}"))

  def arrive(self, step: int, plan: Plan, phase: str = "sync") -> None:
    """Wait until every live process of ``plan`` reached ``phase`` of ``step``.

    Raises:
      ProcessLost: a peer was declared lost first (``processes.arrival``).
    """
    self.arrival.wait(step, self.plan_processes(plan) - self.lost_processes, phase)

  def compile_seconds_of(self, step: int, plan: Plan, seconds: float
                         ) -> dict[int, float | None] | None:
    """Each live process's ``seconds`` (compile seconds of a recovery, to its first step
    ``step`` on ``plan``), gathered by the lowest live one (``Arrival.report``; None for a
    peer lost or silent for 30 s); None on the other processes, and in a job that does not
    arrive."""
    if not self.arrives_at_start(plan):
      return None
    said = self.arrival.report("compile_s", step, repr(seconds),
                               self.plan_processes(plan) - self.lost_processes,
                               reader=min(self.live_processes()))
    if not said:
      return None
    return {p: None if v is None else float(v) for p, v in sorted(said.items())}

  def step_starts(self, compiles: bool) -> None:
    """A loss found while a step compiles is taken over once it has: allow for that."""
    if self.arrival is not None and compiles:
      self.job.heartbeat.takeover_s = max(self.takeover_base_s, COMPILE_TAKEOVER_S)

  def between_steps_starts(self) -> None:
    """A save or an evaluation: it may compile, and orbax's barriers over the live processes
    wait up to 300 s for a peer lost inside them before raising. Allow for that, as for a
    compile (the next step's end sets it back)."""
    self.step_starts(compiles=True)

  def recovery_starts(self) -> None:
    """A loss found while the state moves onto a new plan is taken over when the move has
    failed and voted (steps that commit): its programs may compile, and each of its
    collectives with the lost peer waits for the collective bound. Allow for that, as for a
    compile (the next step's end sets it back)."""
    self.step_starts(compiles=True)

  def step_ended(self, elapsed_s: float, compiled: bool) -> None:
    """A loss found mid-step is taken over at the next arrival: allow a few steps' time (a
    step that compiled says nothing of the next one's)."""
    if self.arrival is not None:
      self.job.heartbeat.takeover_s = max(self.takeover_base_s,
                                          0.0 if compiled else 3 * elapsed_s)

  def devices_of(self, processes: Collection[int]) -> set[jax.Device]:
    """The job's devices that ``processes`` drive."""
    return {d for d in self.devices if d.process_index in processes}

  def slots_of(self, devices: Collection[jax.Device], tp: int) -> set[tuple[int, int]]:
    """The ``(replica, slot)`` pairs of ``devices`` (the job's devices are slot-major per
    replica, ``tp`` slots each)."""
    return {(i // tp, i % tp) for i, d in enumerate(self.devices) if d in devices}

  def take_loss(self, lost: ProcessLost, step: int, tp: int,
                failed: frozenset[tuple[int, int]], inside: bool = True) -> list[Event]:
    """Go on without the lost processes (``distributed.recoverable``): their devices join
    the lost ones, and the ``fail`` events of their slots not failed yet are returned for
    the run to apply (inside ``step``, or before it: ``inside=False``, met in a save or an
    evaluation after the step before)."""
    gone = self.devices_of(lost.processes)
    self.lost_devices |= gone
    self.job.lost.update(lost.processes)  # the lowest live process speaks from now on
    events = [Event(step, inside, "fail", r, s) for r, s in sorted(self.slots_of(gone, tp))
              if (r, s) not in failed]
    self.log(f"step {step}: {lost.message}; process {self.job.process_id} goes on without "
             f"it (distributed.recoverable): {len(gone)} device(s) fail")
    self.event("process_lost", step=step, processes=sorted(lost.processes), time=time.time())
    self.arrival.epoch += 1
    return events

  def stop(self, lost: ProcessLost, state: JustInTimeState, checkpoints) -> ProcessStop:
    """The loss ends this process: the last completed step written as a just-in-time
    checkpoint where possible (``training.just_in_time``); returns the ``ProcessStop`` to raise.
    """
    survivors = self.live_processes() - set(lost.processes)
    message = write_just_in_time(self.job, lost, survivors, state, checkpoints, self.log,
                                 self.event)
    return ProcessStop(message)


def end_after_grace(stop: ProcessStop, grace_s: float = STOP_GRACE_S) -> None:
  """Should the way out after ``stop`` wait on the lost peer, end the process after
  ``grace_s`` seconds from a thread (``heartbeat.end_process``)."""
  backstop = threading.Timer(grace_s, end_process, (stop.message,))
  backstop.daemon = True
  backstop.start()
