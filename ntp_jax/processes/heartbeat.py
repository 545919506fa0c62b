"""Lost processes and agreed stops in a multi-process job, over the coordination service.

``Heartbeat`` names a peer process that went silent and ends this one;
``StopAgreement`` turns a stop signal reaching one process into one step at
which every process stops. Both keep counters in the key-value store of
``jax.distributed``'s coordination service.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

LOST_EXIT_CODE = 3  # a survivor's exit status when a peer process is lost


class Heartbeat:
  """Watches the other processes through the coordination service's key-value store.

  Each process writes a counter under ``ntp_jax/heartbeat/<index>`` every
  ``timeout_s / 6`` seconds and reads the others'. A peer whose counter has
  not moved for ``timeout_s`` (or a coordinator that cannot be reached for
  that long) is lost: ``on_lost`` is called with one line naming it, by
  default printing it and ending the process with ``LOST_EXIT_CODE``, from a
  thread, so even a main thread blocked in a collective stops. A process
  that ends normally marks itself done first (``stop``) and is not missed.

  With ``takeover_s``, a loss is first offered to the main thread: it is
  recorded (``lost``, ``lost_processes``) and the main thread, at its next
  step boundary, calls ``take_over`` and handles it (goes on without the
  peer, or writes a just-in-time checkpoint). A main thread that does not
  within ``takeover_s`` is stuck in a collective with the lost peer: then
  ``on_lost`` ends the process as without it. After a take-over the
  heartbeat watches the remaining peers.

  Args:
    client: ``jax._src.distributed.global_state.client``.
    process_id, num_processes: this process and the job's count.
    timeout_s: ``distributed.heartbeat_timeout_s``.
    on_lost: called once with the message (tests pass their own).
    takeover_s: seconds the main thread gets to take a loss over; None: no take-over.
  """

  def __init__(self, client, process_id: int, num_processes: int, timeout_s: float,
               on_lost: Callable[[str], None] | None = None, takeover_s: float | None = None):
    self.client = client
    self.process_id = process_id
    self.num_processes = num_processes
    self.timeout_s = timeout_s
    self.interval_s = max(0.05, timeout_s / 6)
    self.on_lost = on_lost or end_process
    self.takeover_s = takeover_s
    # What a restart resumes from (the run sets it once its checkpoints are known).
    self.restart_hint: Callable[[], str] = lambda: "restart the job from its last checkpoint"
    self.lost: str | None = None
    self.lost_processes: set[int] = set()  # found lost (offered to the main thread)
    self._taken = threading.Event()
    self._verdicts = self._verdicts_taken = 0  # losses found; of them, taken over
    self._declared: set[int] = set()  # peers a verdict was given on (by any watcher)
    self._lock = threading.Lock()
    now = time.monotonic()
    self._last_change = {p: now for p in range(num_processes) if p != process_id}
    self._last_value: dict[int, str | None] = dict.fromkeys(self._last_change)
    self._last_ok = now
    self._done: set[int] = set()
    self._stop = threading.Event()
    self._threads = [threading.Thread(target=self._beat, name="ntp-heartbeat", daemon=True),
                     threading.Thread(target=self._judge, name="ntp-heartbeat-judge",
                                      daemon=True)]

  def start(self) -> Heartbeat:
    for thread in self._threads:
      thread.start()
    return self

  def stop(self) -> None:
    """This process is finishing normally: tell the others, stop watching."""
    self._stop.set()
    try:
      self.client.key_value_set(f"ntp_jax/done/{self.process_id}", "1", allow_overwrite=True)
    except Exception:  # the coordinator may already be gone at the very end
      pass

  def _beat(self) -> None:
    count = 0
    while not self._stop.is_set():
      count += 1
      try:
        self.client.key_value_set(f"ntp_jax/heartbeat/{self.process_id}", str(count),
                                  allow_overwrite=True)
        now = time.monotonic()
        self._last_ok = now
        for peer in self._last_change:
          if peer in self._done:
            continue
          if is_done(self.client, peer):
            self._done.add(peer)
            continue
          value = _try_get(self.client, f"ntp_jax/heartbeat/{peer}")
          if value != self._last_value[peer]:
            self._last_value[peer], self._last_change[peer] = value, now
      except Exception:  # the coordinator is unreachable: _judge counts the silence
        pass
      self._stop.wait(self.interval_s)

  def _judge(self) -> None:
    while not self._stop.wait(self.interval_s):
      now = time.monotonic()
      if now - self._last_ok > self.timeout_s:
        self._lose(0, "the coordinator (process 0) cannot be reached "
                   f"(distributed.heartbeat_timeout_s={self.timeout_s:g})", offer=False)
        return
      lost = [(peer, now - seen) for peer, seen in self._last_change.items()
              if peer not in self._done and not self._known_lost(peer)
              and now - seen > self.timeout_s]
      for peer, silent in lost:
        if not self._lose(peer, f"no heartbeat for {silent:.1f} s "
                          f"(distributed.heartbeat_timeout_s={self.timeout_s:g})"):
          return

  def report_closed(self, peer: int, why: str) -> None:
    """A peer found dead by other means (``processes.links``: its connection closed): it is
    lost at once, as the heartbeat would declare it after its timeout. Thread-safe; a peer
    already declared lost or finished is not declared again."""
    if peer in self._done or self._known_lost(peer) or self._stop.is_set():
      return
    threading.Thread(target=self._lose, args=(peer, why), name="ntp-heartbeat-lost",
                     daemon=True).start()

  def _known_lost(self, peer: int) -> bool:
    """Declared lost here, or agreed lost by the survivors (``lost_processes``)."""
    return peer in self._declared or peer in self.lost_processes

  def _lose(self, peer: int, why: str, offer: bool = True) -> bool:
    """A lost peer; True when the main thread took it over (keep watching the others)."""
    with self._lock:
      if offer and self._known_lost(peer):  # another watcher spoke first
        return True
      self._declared.add(peer)
      self.lost = f"lost process {peer} of {self.num_processes}: {why}"
      self._verdicts += 1
      if offer and self.takeover_s is not None:
        self._taken.clear()
        self.lost_processes.add(peer)
    if offer and self.takeover_s is not None:
      if self._taken.wait(self.takeover_s):
        return True
      self.on_lost(f"{self.lost}; process {self.process_id} is held in a collective with it "
                   f"and stops; {self.restart_hint()}")
      return False
    self.on_lost(f"{self.lost}; process {self.process_id} stops; {self.restart_hint()}")
    return False

  def take_over(self) -> set[int]:
    """The main thread handles the losses found so far (returns them); the heartbeat
    stops counting down to ending the process, and watches the other peers."""
    self._verdicts_taken = self._verdicts
    self._taken.set()
    return set(self.lost_processes)

  def wait_for_verdict(self) -> str | None:
    """After an error in a collective: wait up to the timeout for a lost peer to show.

    Returns the lost-process line, or None if every peer still answers (the
    error was this process's own); a loss taken over already does not count.
    """
    deadline = time.monotonic() + self.timeout_s + 2 * self.interval_s
    while self._verdicts == self._verdicts_taken and time.monotonic() < deadline:
      time.sleep(self.interval_s / 2)
    return self.lost if self._verdicts > self._verdicts_taken else None


class StopAgreement:
  """A stop request (SIGTERM, Ctrl-C) that every process takes at the same step boundary.

  The process that gets the signal publishes ``step + 2`` under
  ``ntp_jax/stop`` in the coordination service (the first request wins);
  every process reads it at each step boundary. The processes are never
  more than one step apart (each step ends in a collective), so all of them
  read the key before reaching that step, stop there and write the same
  final checkpoint.
  """

  KEY = "ntp_jax/stop"

  def __init__(self, client):
    self.client = client
    self._published = False

  def due(self, step: int, received: str | None) -> str | None:
    """The signal's name when the job stops before ``step``, else None."""
    if received is not None and not self._published:
      self._published = True
      try:
        self.client.key_value_set(self.KEY, f"{step + 2}:{received}")
      except Exception:  # already set by another process: its step stands
        pass
    value = _try_get(self.client, self.KEY)
    if value is None:
      return None
    at, name = value.split(":", 1)
    return name if step >= int(at) else None


def is_done(client, process: int) -> bool:
  """Whether ``process`` marked itself done (``Heartbeat.stop``): it ended normally."""
  return _try_get(client, f"ntp_jax/done/{process}") is not None


def _try_get(client, key: str) -> str | None:
  try:
    return client.key_value_try_get(key)
  except Exception:  # NOT_FOUND: the key was never written
    return None


def end_process(message: str) -> None:
  """Print ``error: message`` and end the process with ``LOST_EXIT_CODE``.

  The one place the library ends a process, and only from a watching thread: the main
  thread is then held in a collective (or a just-in-time write) with a lost peer and
  cannot return. Every decision the main thread makes returns instead
  (``training.process_guard.ProcessStop``).
  """
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(LOST_EXIT_CODE)
