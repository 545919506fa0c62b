"""The commit rule of a step (``processes.commit``): every process that returns reads the same
votes, whoever wrote them, and the same lost set; processes run as threads over one store."""

import threading
import time

import pytest

from ntp_jax.processes.commit import FAIL, LOST, OK, StepVote, committed


class Store:
  """The coordination service's key-value store as ``StepVote`` uses it: a key is written
  once unless overwriting is allowed; a blocking read waits up to its timeout."""

  def __init__(self):
    self.values, self.lock = {}, threading.Lock()

  def key_value_set(self, key, value, allow_overwrite=False):
    with self.lock:
      if key in self.values and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: {key}")
      self.values[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    deadline = time.monotonic() + timeout_ms / 1000
    while time.monotonic() < deadline:
      with self.lock:
        if key in self.values:
          return self.values[key]
      time.sleep(0.001)
    raise TimeoutError(key)

  def key_value_delete(self, key):
    with self.lock:
      self.values.pop(key, None)


class Heartbeat:
  def __init__(self, lost=()):
    self.lost_processes, self.timeout_s, self.interval_s = set(lost), 0.3, 0.05


def _vote_all(store, oks, heartbeats, point="7/sync", epoch=0, voters=None):
  """Each process ``p`` of ``oks`` votes ``oks[p]`` (None: it never votes: it is dead) in a
  thread, through ``voters[p]`` (default: a new ``StepVote``); returns ``process -> votes``
  for those that vote."""
  participants, out = sorted(oks), {}
  voters = voters or {p: StepVote(store, p, heartbeats[p], poll_s=0.01) for p in oks}

  def run(p):
    out[p] = voters[p].decide(epoch, point, participants, oks[p])
  threads = [threading.Thread(target=run, args=(p,)) for p in participants if oks[p] is not None]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=10)
  return out


def test_a_phase_commits_only_when_every_participant_voted_ok():
  store = Store()
  votes = _vote_all(store, {0: True, 1: True, 2: True}, {p: Heartbeat() for p in range(3)})
  assert all(v == {0: OK, 1: OK, 2: OK} for v in votes.values()) and all(
      committed(v) for v in votes.values())
  # One collective raised in process 1: nobody commits, and all read the same votes.
  store = Store()
  votes = _vote_all(store, {0: True, 1: False, 2: True}, {p: Heartbeat() for p in range(3)})
  assert [votes[p] for p in range(3)] == [{0: OK, 1: FAIL, 2: OK}] * 3
  assert not any(committed(v) for v in votes.values())


def test_a_peer_lost_before_voting_is_voted_lost_once_and_learns_it_if_it_comes_back():
  """Process 2 never votes; the survivors' heartbeats name it: the first to write its vote
  writes ``lost``, the other reads that. A process 2 that was only slow finds its own vote
  taken when it comes (its write is refused)."""
  store = Store()
  heartbeats = {p: Heartbeat(lost={2}) for p in range(3)}
  votes = _vote_all(store, {0: True, 1: True, 2: None}, heartbeats)
  assert votes[0] == votes[1] == {0: OK, 1: OK, 2: LOST}
  late = StepVote(store, 2, Heartbeat(), poll_s=0.01).decide(0, "7/sync", [0, 1, 2], True)
  assert late[2] == LOST and not committed(late)


def test_a_vote_given_before_a_death_stands():
  """Process 2 voted ok, then died: its vote is read as it is, the phase commits everywhere
  (its loss is met at the next arrival), even where the heartbeat names it already."""
  store = Store()
  store.key_value_set("ntp_jax/vote/0/7/finish/2", OK)  # its vote, before it died
  votes = _vote_all(store, {0: True, 1: True, 2: None},
                    {0: Heartbeat(lost={2}), 1: Heartbeat(), 2: None}, point="7/finish")
  assert votes[0] == votes[1] == {0: OK, 1: OK, 2: OK} and committed(votes[0])


def test_the_lost_set_of_a_phase_is_the_first_proposal():
  """Survivors whose heartbeats name different processes (a second loss seen by one only)
  agree on the set written first; with nothing named in time, none."""
  store = Store()
  votes = {0: OK, 1: FAIL, 2: OK, 3: LOST}
  first = StepVote(store, 0, Heartbeat(lost={3}), poll_s=0.01)
  assert first.agree_lost(0, "7/grad", range(4), votes, wait_s=1) == {3}
  second = StepVote(store, 2, Heartbeat(lost={1, 3}), poll_s=0.01)
  assert second.agree_lost(0, "7/grad", range(4), votes, wait_s=1) == {3}
  # Only process 1's collective raised, and nobody is named: not a loss.
  quiet = StepVote(Store(), 0, Heartbeat(), poll_s=0.01)
  assert quiet.agree_lost(0, "8/grad", range(4), {0: OK, 1: FAIL}, wait_s=0.1) == frozenset()


@pytest.mark.parametrize("points", [5])
def test_old_votes_leave_the_store(points):
  """Each process deletes its own vote two points back: the store stays small."""
  store = Store()
  voters = {p: StepVote(store, p, Heartbeat(), poll_s=0.01) for p in (0, 1)}
  for i in range(points):
    _vote_all(store, {0: True, 1: True}, None, point=f"{i}/sync", voters=voters)
  assert sorted(store.values) == sorted(f"ntp_jax/vote/0/{i}/sync/{p}" for i in (3, 4)
                                        for p in (0, 1))
