"""Compiling ahead: the programs of the plans one more failure or repair can reach.

The plans a failure can lead to are known before it happens: from the
current failed set, one more failed device of any replica, or one repair
(``plan.reachable_failed_sets``). ``Precompiler`` compiles, in a background
thread while training goes on, every program a recovery onto each of them
would run: the state moves, each class's step (or its two halves) and the
cross-class sync (``programs.PlanPrograms.lower``). A failure then costs the
plan, the state move and the first step, without compiling (``ntp.precompile``).

Compiled programs are the very ones the loop calls (the same ``jax.jit``
objects, through ``programs.ProgramCache``), so nothing about a result
changes. The worker stops at a bound on the programs it compiles per plan
change and on the host memory the process grows by.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from ntp_jax.parallel.programs import ProgramCache
from ntp_jax.training.compilation import host_resident_bytes


@dataclasses.dataclass(frozen=True)
class PlanJob:
  """The programs of one reachable plan, made (lowered) when the worker gets to it.

  Attributes:
    failed: the plan's failed ``(replica, slot)`` pairs (what ``settle`` asks for).
    origin: the failed set of the plan its state moves from (the moves depend on it).
    label: one line for the log, e.g. ``fail 0:3 -> TP degrees [3, 4]``.
    lower: ``() -> [(what, cache key or None, jax.stages.Lowered)]``.
    lost: the processes whose loss leads there (their moves differ from a failure of the
      same devices: the lost rows take no part).
  """

  failed: frozenset
  label: str
  lower: Callable[[], list[tuple[str, Hashable | None, Any]]]
  origin: frozenset = frozenset()
  lost: frozenset = frozenset()

  @property
  def move(self) -> tuple[frozenset, frozenset, frozenset]:
    """``(origin, failed, lost)``: what ``Precompiler.ready`` holds once the job is
    compiled."""
    return self.origin, self.failed, self.lost


class Precompiler:
  """A background thread compiling the programs of ``PlanJob``s, newest schedule only.

  Args:
    cache: the run's ``ProgramCache``: compiled keys are marked there.
    log: one-line logger.
    max_programs: programs compiled per schedule at most (0: no bound).
    max_host_bytes: stop when the process's resident memory has grown by this
      much since the first schedule (0: no bound).
  """

  def __init__(self, cache: ProgramCache, log: Callable[[str], None], *, max_programs: int,
               max_host_bytes: int):
    self.cache = cache
    self.log = log
    self.max_programs = max_programs
    self.max_host_bytes = max_host_bytes
    self._cv = threading.Condition()
    self._jobs: list[PlanJob] = []
    self._generation = 0
    self._in_flight: PlanJob | None = None
    self._thread: threading.Thread | None = None
    self._closed = False
    self._rss_start: int | None = None
    # (origin, failed, lost) moves whose every program is compiled: the target's steps and
    # sync, and the state moves from the origin's plan
    self.ready: set[tuple[frozenset, frozenset, frozenset]] = set()
    self.compiled = 0  # programs compiled ahead over the run
    self.seconds = 0.0  # wall seconds the worker spent compiling

  def schedule(self, jobs: list[PlanJob]) -> None:
    """Drop the work not yet started and compile ``jobs`` next, in order."""
    with self._cv:
      self._generation += 1
      self._jobs = [j for j in jobs if j.move not in self.ready]
      if self._rss_start is None:
        self._rss_start = host_resident_bytes()
      if self._thread is None:
        self._thread = threading.Thread(target=self._work, name="ntp-precompile", daemon=True)
        self._thread.start()
      self._cv.notify_all()

  @property
  def busy(self) -> bool:
    """Work is queued or compiling."""
    with self._cv:
      return bool(self._jobs) or self._in_flight is not None

  def settle(self, failed: frozenset) -> float:
    """Before a move onto the plan of ``failed``: drop queued work, and wait while the worker
    is compiling that very plan (logged). Returns the seconds waited."""
    start = time.perf_counter()
    with self._cv:
      self._generation += 1
      self._jobs = []
      if self._in_flight is not None and self._in_flight.failed == failed:
        self.log(f"  waiting for the ahead-of-time compile of this plan "
                 f"({self._in_flight.label}) to finish")
        while self._in_flight is not None and self._in_flight.failed == failed:
          self._cv.wait()
    return time.perf_counter() - start

  def wait_idle(self, timeout: float | None = None) -> bool:
    """Block until nothing is queued or compiling; False on timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cv:
      while self._jobs or self._in_flight is not None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          return False
        self._cv.wait(left)
    return True

  def close(self, timeout: float = 120.0) -> None:
    """Stop: drop queued work, let the program in flight finish (at most ``timeout`` s)."""
    with self._cv:
      self._closed = True
      self._generation += 1
      self._jobs = []
      self._cv.notify_all()
    if self._thread is not None:
      self._thread.join(timeout)

  def _work(self) -> None:
    generation, count, start, plans = -1, 0, 0.0, 0
    while True:
      with self._cv:
        while not self._jobs and not self._closed:
          if generation == self._generation and plans:
            grown = (host_resident_bytes() - (self._rss_start or 0)) / 2**30
            self.log(f"compiled ahead: {count} program(s) for {plans} plan(s) one failure or "
                     f"repair away, in {time.perf_counter() - start:.1f} s (host memory "
                     f"{grown:+.2f} GiB since the first compile ahead)")
            plans = 0
          self._cv.wait()
        if self._closed:
          return
        if generation != self._generation:  # a new schedule: count afresh
          generation, count, start, plans = self._generation, 0, time.perf_counter(), 0
        job = self._in_flight = self._jobs.pop(0)
      began = time.perf_counter()
      try:
        complete, count = self._compile(job, generation, count)
      except Exception as err:  # noqa: BLE001 -- a stale plan's state may be gone; say, go on
        complete = False
        if generation == self._generation:
          self.log(f"  compile ahead of {job.label} failed: {type(err).__name__}: {err}")
      with self._cv:
        self.seconds += time.perf_counter() - began
        if complete:
          self.ready.add(job.move)
          plans += 1
        self._in_flight = None
        self._cv.notify_all()

  def _compile(self, job: PlanJob, generation: int, count: int) -> tuple[bool, int]:
    """Lower and compile ``job``'s programs; ``(all compiled, programs counted)``. A cache
    key is marked compiled once every program under it is (a split step has two)."""
    programs = job.lower()
    left = collections.Counter(key for _, key, _ in programs if key is not None)
    for _, key, lowered in programs:
      if generation != self._generation:
        return False, count
      if self.max_programs and count >= self.max_programs:
        self._stop(f"{self.max_programs} programs (ntp.precompile_max_programs)", generation)
        return False, count
      grown = host_resident_bytes() - (self._rss_start or 0)
      if self.max_host_bytes and grown > self.max_host_bytes:
        self._stop(f"{grown / 2**30:.1f} GiB of host memory grown "
                   "(ntp.precompile_max_host_gb)", generation)
        return False, count
      lowered.compile()
      count += 1
      self.compiled += 1
      if key is not None:
        left[key] -= 1
        if not left[key]:
          self.cache.mark_compiled([key])
    return True, count

  def _stop(self, why: str, generation: int) -> None:
    with self._cv:
      if generation == self._generation:
        self._jobs = []
    self.log(f"compile ahead: stopped at {why}; the other plans compile when met")
