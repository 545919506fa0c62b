"""``WORKDIR/goodput.png``: the whole run across resumes, read back from ``metrics.jsonl``.

A run is every session since the last ``start`` event (each resume appends
to the same file, ``training.metrics``): ``gather_series`` reads the step
records (the last record of a step wins: steps redone after a restart are
drawn once) and the event rows, and ``plot_series`` draws the training and
validation loss, tokens per second and goodput per step, with stops,
resumes (after a stop or a crash), failures and repairs marked, under a
title naming the config and the plan.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ntp_jax.training.metrics import read_records

# Line colour of each kind of mark.
COLORS = {"fail": "tab:red", "repair": "tab:green", "stop": "tab:gray", "resume": "tab:blue"}


@dataclasses.dataclass(frozen=True)
class Mark:
  """A vertical line on the plot: ``kind`` is a key of ``COLORS``."""

  step: int
  kind: str
  label: str


@dataclasses.dataclass
class RunSeries:
  """What the plot draws, per step of the whole run.

  Attributes:
    steps, loss, tokens_per_s, goodput: one entry per step (its last record);
      ``tokens_per_s`` is None on steps that compiled, ``goodput`` None where
      a record lacks it.
    val_steps, val_loss: the steps that evaluated and their validation loss.
    marks: stops, resumes, failures and repairs, in file order.
    sessions: processes that wrote the run (1 + resumes).
    plans: the plan summary (``Plan.summary``) of each session's start.
    final_degrees: the live replicas' TP degrees at the last step.
    degrees: the live replicas' TP degrees the run went through, in step order, each change
      once (``"8,8"``, ``"8,7"``, ...); from the step records, else the sessions' plans.
  """

  steps: list[int] = dataclasses.field(default_factory=list)
  loss: list[float] = dataclasses.field(default_factory=list)
  tokens_per_s: list[float | None] = dataclasses.field(default_factory=list)
  goodput: list[float | None] = dataclasses.field(default_factory=list)
  val_steps: list[int] = dataclasses.field(default_factory=list)
  val_loss: list[float] = dataclasses.field(default_factory=list)
  marks: list[Mark] = dataclasses.field(default_factory=list)
  sessions: int = 0
  plans: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  final_degrees: list[int] = dataclasses.field(default_factory=list)
  degrees: list[str] = dataclasses.field(default_factory=list)


def gather_series(path: str) -> RunSeries:
  """The whole run of ``metrics.jsonl`` at ``path``: every session since the last ``start``."""
  rows = read_records(path)
  starts = [i for i, r in enumerate(rows) if r.get("event") == "start"]
  series, by_step, ended = RunSeries(), {}, True
  for row in rows[starts[-1] if starts else 0:]:
    event = row.get("event")
    if event is None:
      by_step[row["step"]] = row
      continue
    step = int(row.get("step", 0))
    if event in ("start", "resume"):
      series.sessions += 1
      series.plans.append(row.get("plan", {}))
      if event == "resume":
        after = "" if ended else " after a crash"
        series.marks.append(Mark(step, "resume", f"resume at {step}{after}"))
      ended = False
    elif event == "stop":
      why = row.get("signal") or (f"hook {row['hook']}" if "hook" in row else "signal")
      series.marks.append(Mark(step, "stop", f"stop ({why})"))
      ended = True
    elif event == "end":
      ended = True
    elif event in ("fail", "repair"):
      where = f"{row.get('replica')}:{row.get('slot')}"
      series.marks.append(Mark(step, event, f"{event} {step}{'.mid' if row.get('mid') else ''}"
                                            f"@{where}"))
  if by_step:
    last = by_step[max(by_step)]
    series.final_degrees = list(last.get("tp_degrees")
                                or ([last["tp_degree"]] if "tp_degree" in last else []))
  for step in sorted(by_step):
    record = by_step[step]
    degrees = record.get("tp_degrees") or ([record["tp_degree"]] if "tp_degree" in record
                                           else None)
    if degrees is not None:
      _append_change(series.degrees, ",".join(map(str, degrees)))
    series.steps.append(step)
    series.loss.append(record["loss"])
    series.tokens_per_s.append(None if record.get("compiled")
                               else record["tokens"] / record["step_time_s"])
    series.goodput.append(record.get("goodput"))
    if "val_loss" in record:
      series.val_steps.append(step)
      series.val_loss.append(record["val_loss"])
  return series


def run_title(workdir: str, model: Any, series: RunSeries) -> str:
  """``WORKDIR: FACTORY (d_model 128, layers 2, vocab 2,048); mesh 1 x 8, TP degrees 8 -> 7 -> 8``
  (the first session's mesh, the TP degrees the run went through).

  ``model`` is the config's ``model`` section; the shape fields shown are those it has.
  """
  shape = ", ".join(f"{label} {model[key]:,}" for key, label in
                    (("d_model", "d_model"), ("n_layers", "layers"), ("vocab_size", "vocab"))
                    if key in model)
  text = f"{workdir}: {model['factory']}" + (f" ({shape})" if shape else "")
  if series.plans:
    first = series.plans[0]
    text += f"; mesh {first.get('dp')} x {first.get('tp')}, TP degrees {_went_through(series)}"
  sessions = f", {series.sessions} sessions" if series.sessions > 1 else ""
  return text + sessions


# Longer histories show their first and last few degrees around the count of changes.
MAX_DEGREES_SHOWN = 6


def _went_through(series: RunSeries) -> str:
  """``8 -> 7 -> 8``: the degrees the run went through (the sessions' plans where the records
  carry none), the middle of a long history elided."""
  seen = list(series.degrees)
  if not seen:
    for plan in series.plans:
      _append_change(seen, _degrees(plan))
  if len(seen) > MAX_DEGREES_SHOWN:
    half = MAX_DEGREES_SHOWN // 2
    seen = seen[:half] + [f"... ({len(seen) - 1} changes)"] + seen[-half:]
  return " -> ".join(seen)


def _append_change(seen: list[str], degrees: str) -> None:
  if not seen or seen[-1] != degrees:
    seen.append(degrees)


def _degrees(plan: dict[str, Any]) -> str:
  return ",".join(str(len(r["live_slots"])) for r in plan.get("replicas", [])) or "?"


def plot_series(series: RunSeries, path: str, title: str) -> None:
  """PNG at ``path``: loss (training line, validation points), tokens/s and goodput per step,
  every mark a dashed line labelled at the top."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  fig, (loss_ax, speed_ax, good_ax) = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
  loss_ax.plot(series.steps, series.loss, lw=1, label="training")
  if series.val_steps:
    loss_ax.plot(series.val_steps, series.val_loss, "o-", ms=3, lw=1, label="validation")
  loss_ax.set_ylabel("loss")
  loss_ax.legend(loc="upper right", fontsize=8)
  timed = [(s, v) for s, v in zip(series.steps, series.tokens_per_s) if v is not None]
  speed_ax.plot([s for s, _ in timed], [v for _, v in timed], lw=1)
  speed_ax.set_ylabel("tokens / s")
  good = [(s, v) for s, v in zip(series.steps, series.goodput) if v is not None]
  good_ax.plot([s for s, _ in good], [v for _, v in good], lw=1)
  good_ax.set_ylabel("goodput (session)")
  good_ax.set_xlabel("step")
  good_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  for mark in series.marks:
    color = COLORS[mark.kind]
    for ax in (loss_ax, speed_ax, good_ax):
      ax.axvline(mark.step, color=color, ls="--", lw=1)
    loss_ax.annotate(mark.label, (mark.step, 0.97), xycoords=("data", "axes fraction"),
                     rotation=90, va="top", ha="right", fontsize=7, color=color)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
