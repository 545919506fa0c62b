"""Before a step's collectives across processes: every process says it has arrived.

On CPU (gloo) a collective whose peer process died never returns, and on any
platform a program already running cannot be called back, so a survivor
must learn of a loss *before* it enters the step's first collective across
processes. ``Arrival.wait`` is that point: each process publishes ``arrived
at step s`` in the coordination service's key-value store and waits for every
peer's, twice a step: before the step's first program, once the last step
has ended on every local device (its loss is read from one device, so its
sync can still run on the others, and a peer that dies then holds them in
it), and after its own gradients, before the gradient sync. A peer
that never arrives is one the heartbeat declares lost; the wait then raises
``ProcessLost``, with the step's state untouched (the update has not run),
so the survivors can write it (a just-in-time checkpoint) or go on without
the peer (``distributed.recoverable``). A peer lost *inside* the sync, after
it arrived, still holds the survivors in the collective; the heartbeat ends
them then (``heartbeat.Heartbeat``'s take-over).
"""

from __future__ import annotations

import time
from collections.abc import Collection

from ntp_jax.processes.heartbeat import Heartbeat


class ProcessLost(Exception):
  """Peer processes were lost before step ``step``'s collectives across processes.

  Attributes:
    processes: the lost process indices. step: the step in flight (not applied).
    message: the heartbeat's line naming them.
  """

  def __init__(self, processes: Collection[int], step: int, message: str):
    self.processes = frozenset(processes)
    self.step = step
    self.message = message
    super().__init__(message)


ARRIVAL_PREFIX = "ntp_jax/arrived"
REPORT_PREFIX = "ntp_jax/report"


def arrival_key(epoch: int, step: int, process: int, phase: str = "sync") -> str:
  """The key-value store key under which ``process`` arrives at ``phase`` of ``step`` while
  the plan is in its ``epoch`` (raised at every lost process)."""
  return f"{ARRIVAL_PREFIX}/{epoch}/{step}/{phase}/{process}"


class Arrival:
  """The per-step arrival of every process, over the coordination service.

  Args:
    client: the ``jax.distributed`` key-value client.
    process_id: this process.
    heartbeat: the job's ``Heartbeat`` (with a take-over: ``takeover_s``).
    poll_s: how long one wait for a peer's key lasts before the heartbeat is asked.
  """

  def __init__(self, client, process_id: int, heartbeat: Heartbeat, poll_s: float = 0.05):
    self.client = client
    self.process_id = process_id
    self.heartbeat = heartbeat
    self.poll_ms = max(1, int(poll_s * 1000))
    self.epoch = 0  # raised at every change of plan: a step redone waits afresh

  def key(self, step: int, process: int, phase: str = "sync") -> str:
    return arrival_key(self.epoch, step, process, phase)

  def wait(self, step: int, processes: Collection[int], phase: str = "sync") -> None:
    """Publish this process's arrival at ``phase`` of ``step`` (``start``: before any of
    its programs; ``sync``: after its gradients); return once every one of ``processes``
    (this one included) has arrived there.

    Raises:
      ProcessLost: the heartbeat declared one of ``processes`` lost first; the take-over
        is this process's (``Heartbeat.take_over``).
    """
    self.client.key_value_set(self.key(step, self.process_id, phase), "1",
                              allow_overwrite=True)
    for peer in sorted(set(processes) - {self.process_id}):
      while True:
        try:
          self.client.blocking_key_value_get(self.key(step, peer, phase), self.poll_ms)
          break
        except Exception:  # not there yet (the wait timed out)
          lost = self.heartbeat.lost_processes & set(processes)
          if lost:
            self.heartbeat.take_over()
            raise ProcessLost(lost, step, self.heartbeat.lost) from None
    try:  # keep the store small: this process's key of two steps ago is read by everyone
      self.client.key_value_delete(self.key(step - 2, self.process_id, phase))
    except Exception:
      pass

  def report(self, name: str, step: int, value: str, processes: Collection[int],
             reader: int = 0, timeout_s: float = 30.0) -> dict[int, str | None]:
    """Every process of ``processes`` says ``value`` under ``name`` at ``step``; ``reader``
    (process 0: it writes the metrics) waits for each peer's, the others return at once.

    The reader waits at most ``timeout_s`` in all, and not for a peer the heartbeat has
    declared lost: such a peer's value is None (the next arrival meets the loss; a report
    raises nothing).

    Returns:
      ``process -> value`` for the reader (its own included); ``{}`` for the others.
    """
    prefix = f"{REPORT_PREFIX}/{self.epoch}/{step}/{name}"
    self.client.key_value_set(f"{prefix}/{self.process_id}", value, allow_overwrite=True)
    if self.process_id != reader:
      return {}
    values: dict[int, str | None] = {self.process_id: value}
    deadline = time.monotonic() + timeout_s
    for peer in sorted(set(processes) - {self.process_id}):
      values[peer] = None
      while time.monotonic() < deadline and peer not in self.heartbeat.lost_processes:
        try:
          values[peer] = self.client.blocking_key_value_get(f"{prefix}/{peer}", self.poll_ms)
          break
        except Exception:  # not there yet (the wait timed out)
          pass
    return values
