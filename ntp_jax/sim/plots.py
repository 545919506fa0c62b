"""PNG figures of the simulator's results (matplotlib, Agg backend)."""

from __future__ import annotations

import pathlib
import textwrap
from collections.abc import Sequence

import numpy as np

from ntp_jax.sim.spares import SparesResult
from ntp_jax.sim.sweep import LossPoint
from ntp_jax.sim.timeline import AvailabilityTimeline

_COLORS = {"dp-drop": "tab:red", "ntp": "tab:blue", "ntp-pw": "tab:green"}
_LABELS = {"dp-drop": "DP-DROP", "ntp": "NTP", "ntp-pw": "NTP-PW"}


def _pyplot():
  """``matplotlib.pyplot`` on the non-interactive Agg backend."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def plot_loss_sweep(points: Sequence[LossPoint], path: pathlib.Path, title: str) -> pathlib.Path:
  """Mean (line) and max (dashed) loss in percent against the failed fraction."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for policy in dict.fromkeys(p.policy for p in points):
    mine = [p for p in points if p.policy == policy]
    x = np.array([p.fraction for p in mine])
    color = _COLORS.get(policy)
    ax.plot(x, [100 * p.mean_loss for p in mine], "o-", color=color,
            label=f"{_LABELS.get(policy, policy)} mean")
    ax.plot(x, [100 * p.max_loss for p in mine], "--", color=color,
            label=f"{_LABELS.get(policy, policy)} max")
  _finish_axes(ax, "fraction of GPUs failed", "throughput loss (%)")
  ax.set_title(textwrap.fill(title, 80), fontsize=8)
  return _save(plt, fig, path)


def plot_timeline(result: AvailabilityTimeline, path: pathlib.Path, title: str) -> pathlib.Path:
  """Failed fraction (top) and per-policy availability (bottom) against time in days."""
  plt = _pyplot()
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
  days = result.hours / 24.0
  top.plot(days, 100 * result.failed_fraction, color="black")
  top.set_ylabel("GPUs failed (%)")
  top.grid(alpha=0.3)
  top.set_title(textwrap.fill(title, 90), fontsize=8)
  for policy, values in result.availability.items():
    bottom.plot(days, 100 * values, color=_COLORS.get(policy), label=_LABELS.get(policy, policy))
  _finish_axes(bottom, "time (days)", "availability (%)")
  return _save(plt, fig, path)


def plot_spares(result: SparesResult, path: pathlib.Path, title: str) -> pathlib.Path:
  """Per-GPU throughput against spare domains; markers at the least pause-free count."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for policy, values in result.per_gpu_throughput.items():
    color = _COLORS.get(policy)
    ax.plot(result.spares, values, color=color, label=_LABELS.get(policy, policy))
    needed = result.needed[policy]
    if needed is not None:
      ax.plot([needed], [values[needed]], "o", color=color)
  _finish_axes(ax, "spare scale-up domains", "throughput per GPU (healthy, no spares = 1)")
  ax.set_title(textwrap.fill(title, 80), fontsize=8)
  return _save(plt, fig, path)


def _finish_axes(ax, xlabel: str, ylabel: str) -> None:
  """Axis labels, a light grid and the legend."""
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)


def _save(plt, fig, path: pathlib.Path) -> pathlib.Path:
  """Lay out, write the PNG and free the figure."""
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
