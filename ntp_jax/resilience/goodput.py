"""Goodput accounting: a run's wall time split into named buckets, and its plot.

Buckets: ``productive`` (steps that advance training, after their program
was compiled), ``compile`` (the first step of each newly built set of
programs: tracing and compilation dominate it), ``reconfigure`` (new plan,
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
from typing import Any

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


def plot_run(records: list[dict[str, Any]], events: list[dict[str, Any]], path: str) -> None:
  """PNG of loss and tokens/s per step, failure and repair events marked.

  Args:
    records: step records (``step``, ``loss``, ``tokens``, ``step_time_s``).
    events: ``{"step": int, "label": str, "kind": "fail" | "repair"}``.
    path: the PNG file to write.
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  # A step run again (after a restart) is drawn once, with its last record.
  records = list({r["step"]: r for r in records}.values())
  records.sort(key=lambda r: r["step"])
  steps = [r["step"] for r in records]
  fig, (loss_ax, speed_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  speed_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  loss_ax.plot(steps, [r["loss"] for r in records], lw=1)
  loss_ax.set_ylabel("loss")
  speed_ax.plot(steps, [r["tokens"] / r["step_time_s"] for r in records], lw=1)
  speed_ax.set_ylabel("tokens / s")
  speed_ax.set_xlabel("step")
  for event in events:
    color = "tab:red" if event["kind"] == "fail" else "tab:green"
    for ax in (loss_ax, speed_ax):
      ax.axvline(event["step"], color=color, ls="--", lw=1)
    loss_ax.annotate(event["label"], (event["step"], 0.97), xycoords=("data", "axes fraction"),
                     rotation=90, va="top", ha="right", fontsize=7, color=color)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
