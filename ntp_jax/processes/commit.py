"""Steps that commit: every survivor applies a step's update, or none does.

A collective whose peer process dies is not atomic: one survivor may get the
right result, another an error, another a wrong one with no error (JAX's
fault-tolerance guide, "Fault Tolerant Distributed JAX"). So whether a step
happened is decided by agreement after its collectives, not by whether this
process's collectives raised. ``StepVote`` is that agreement, over the
coordination service's key-value store:

- after each phase of a step's collectives across processes (its gradients,
  the sync, the finish; the move onto a new plan), each participant writes its
  vote for ``(epoch, step, phase)``: ``ok`` when its collectives completed,
  ``fail`` when one raised;
- a participant the heartbeat declares lost before voting gets ``lost``
  written in its place;
- every vote is written once (the store refuses a second write of a key), so
  every process reads the same votes, whoever wrote them: the phase passes
  exactly when all of them are ``ok``, and the update runs after the last;
- a step that does not commit is thrown away by every survivor, and the
  processes lost in it are agreed the same way (the first proposal written
  stands), so every survivor moves onto the same plan.

The update that follows a commit runs no collective across processes, so
nothing can interrupt it half-way on some survivors. Compare TorchFT's
``should_commit`` after its all-reduce, and the membership check of JAX's guide.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from ntp_jax.processes.heartbeat import Heartbeat

VOTE_PREFIX = "ntp_jax/vote"
LOST_PREFIX = "ntp_jax/lost"
OK, FAIL, LOST = "ok", "fail", "lost"


class StepVote:
  """The commit vote of each step, over the coordination service.

  Args:
    client: the ``jax.distributed`` key-value client (``key_value_set`` with
      ``allow_overwrite``, ``blocking_key_value_get``, ``key_value_delete``).
    process_id: this process.
    heartbeat: the job's ``Heartbeat``: who is lost (``lost_processes``).
    poll_s: how long one wait for a peer's vote lasts before the heartbeat is asked.
  """

  def __init__(self, client, process_id: int, heartbeat: Heartbeat, poll_s: float = 0.05):
    self.client, self.process_id, self.heartbeat = client, process_id, heartbeat
    self.poll_ms = max(1, int(poll_s * 1000))
    self._mine: list[str] = []  # this process's vote keys, newest last

  def _write_once(self, key: str, value: str) -> str:
    """Write ``value`` under ``key`` unless it is there; return what the key holds."""
    try:
      self.client.key_value_set(key, value, allow_overwrite=False)
      return value
    except Exception:  # written first by another process: its value stands
      return self.client.blocking_key_value_get(key, 60_000)

  def decide(self, epoch: int, point: str, participants: Collection[int], ok: bool) -> dict:
    """Vote ``ok`` (this process's collectives up to ``point``, e.g. ``"12/sync"``, ended
    well) and wait for every participant's vote, or for the heartbeat to declare it lost
    (``lost`` is then its vote).

    Returns:
      ``process -> vote`` (``"ok"``, ``"fail"`` or ``"lost"``), the same in every process
      that returns; the phase passes when every vote is ``"ok"`` (``committed``).
    """
    prefix = f"{VOTE_PREFIX}/{epoch}/{point}"
    self._mine.append(f"{prefix}/{self.process_id}")
    votes = {self.process_id: self._write_once(self._mine[-1], OK if ok else FAIL)}
    if len(self._mine) > 2:  # every peer voted after it (this process saw their votes): gone
      try:
        self.client.key_value_delete(self._mine.pop(0))
      except Exception:
        pass
    for peer in sorted(set(participants) - {self.process_id}):
      key = f"{prefix}/{peer}"
      while True:
        try:
          votes[peer] = self.client.blocking_key_value_get(key, self.poll_ms)
          break
        except Exception:  # not there yet (the wait timed out)
          if peer in self.heartbeat.lost_processes:
            votes[peer] = self._write_once(key, LOST)
            break
    return votes

  def agree_lost(self, epoch: int, point: str, participants: Collection[int],
                 votes: dict, wait_s: float) -> frozenset[int]:
    """After a step that did not commit: the processes lost in it, the same in every survivor.

    Waits up to ``wait_s`` for the heartbeat to name a lost participant (those voted
    ``lost`` are named already), then proposes them; the first proposal written stands.
    Returns the empty set when none is named in time and no proposal was written (the step
    failed for another reason).
    """
    key = f"{LOST_PREFIX}/{epoch}/{point}"
    named = {p for p, v in votes.items() if v == LOST}
    deadline = time.monotonic() + wait_s
    while True:
      named |= self.heartbeat.lost_processes & set(participants)
      if named:
        return frozenset(int(p) for p in self._write_once(
            key, ",".join(map(str, sorted(named)))).split(","))
      try:  # another survivor named them first
        return frozenset(int(p) for p in self.client.blocking_key_value_get(
            key, self.poll_ms).split(","))
      except Exception:
        if time.monotonic() > deadline:
          return frozenset()


def committed(votes: dict) -> bool:
  """Whether a step whose votes are ``votes`` (``StepVote.decide``) commits."""
  return all(v == OK for v in votes.values())
