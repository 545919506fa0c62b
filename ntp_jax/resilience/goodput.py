"""Goodput accounting: a run's wall time split into named buckets (the plot of a whole run is
``ntp_jax.training.run_plot``).

Buckets: ``productive`` (steps that advance training, after their program
was compiled), ``compile`` (the first step of each newly built set of
programs: tracing and compilation dominate it; what a recovery compiles on
its critical path; waits for the background compile), ``reconfigure`` (new plan,
state moved into the new layouts), ``checkpoint_save`` (the time steps are
held by saves), ``checkpoint_restore``, ``redone`` (work thrown away: a step
cut by a failure inside it, steps repeated after a restart), and ``idle``
(the rest: start-up, data, logging). ``goodput`` is productive / wall time,
as the term is used for training jobs (e.g. Google Cloud's ML goodput: the
fraction of time spent on useful training).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

BUCKETS = ("productive", "compile", "reconfigure", "checkpoint_save", "checkpoint_restore",
           "redone", "eval", "idle")


class GoodputClock:
  """Wall time since construction, split into ``BUCKETS`` (``idle`` is the remainder)."""

  def __init__(self):
    self.start = time.perf_counter()
    self.seconds = dict.fromkeys(BUCKETS[:-1], 0.0)
    self.tokens = 0  # tokens of productive steps

  def add(self, bucket: str, seconds: float) -> None:
    self.seconds[bucket] += seconds

  @contextlib.contextmanager
  def timed(self, bucket: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
      yield
    finally:
      self.add(bucket, time.perf_counter() - start)

  def wall(self) -> float:
    return time.perf_counter() - self.start

  def buckets(self) -> dict[str, float]:
    """Seconds per bucket; they add up to the wall time."""
    wall = self.wall()
    out = dict(self.seconds)
    out["idle"] = max(0.0, wall - sum(self.seconds.values()))
    return out

  def goodput(self) -> float:
    return self.seconds["productive"] / max(self.wall(), 1e-9)

  def effective_tokens_per_s(self) -> float:
    return self.tokens / max(self.wall(), 1e-9)

  def summary(self) -> str:
    """Closing lines: each bucket's seconds and share of the wall time."""
    wall, buckets = self.wall(), self.buckets()
    parts = [f"{name} {seconds:.1f} s ({seconds / wall:.0%})" for name, seconds in buckets.items()
             if seconds > 0]
    return (f"goodput {self.goodput():.3f} over {wall:.1f} s wall, "
            f"{self.effective_tokens_per_s():,.0f} effective tokens/s\n  " + ", ".join(parts))
