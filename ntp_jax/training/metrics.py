"""Per-step metrics: ``WORKDIR/metrics.jsonl`` and the progress line.

The file is only ever appended to. Besides one record per step it holds
event rows (``{"event": "start" | "resume" | "stop", ...}``): a run that
starts afresh writes ``start``, a resumed run ``resume``; so a workdir keeps
the history of every run, and ``read_metrics`` gives the latest run's steps.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Callable
from typing import Any


class MetricsWriter:
  """Appends JSON objects, one per line, to ``<workdir>/metrics.jsonl``.

  Each line is written whole and flushed, so an interrupted run leaves only
  whole lines.

  In a multi-process job only the speaking process writes (``enabled``, asked at each
  write: ``Job.speaker`` changes when that process is lost). The others keep their last
  ``BACKLOG`` rows: a speaker can be lost between a step that every process completed and
  its row, so the next speaker first writes the rows it kept that come after the file's
  last step record (an event row the lost speaker wrote after that record may appear
  twice; ``read_metrics`` keeps one record per step).
  """

  BACKLOG = 1000

  def __init__(self, workdir: str, enabled: bool | Callable[[], bool] = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = None
    self._enabled = enabled if callable(enabled) else (lambda: enabled)
    self._kept: collections.deque[dict[str, Any]] = collections.deque(maxlen=self.BACKLOG)
    if self._enabled():
      self._open()

  def _open(self) -> None:
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    self._file = open(self.path, "a", encoding="utf-8")

  def write(self, record: dict[str, Any]) -> None:
    if not self._enabled():
      self._kept.append(record)
      return
    if self._file is None:  # this process speaks now: its predecessor was lost
      self._open()
      for row in self._missing():
        self._file.write(json.dumps(row) + "\n")
      self._kept.clear()
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()

  def _missing(self) -> list[dict[str, Any]]:
    """The kept rows after the last of them whose step the file has a record of since this
    run began (its ``start`` or ``resume`` row; all of them when it has none of their
    steps)."""
    rows = _rows(self.path)
    begun = [i for i, row in enumerate(rows) if row.get("event") in ("start", "resume")]
    written = {row["step"] for row in rows[begun[-1] if begun else 0:] if "event" not in row}
    kept = list(self._kept)
    known = [i for i, row in enumerate(kept) if "event" not in row and row["step"] in written]
    return kept[known[-1] + 1:] if known else kept

  def event(self, name: str, **fields: Any) -> None:
    """An event row: ``{"event": name, **fields}``."""
    self.write({"event": name, **fields})

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


class TensorBoardWriter:
  """Step records as TensorBoard scalars, through tensorboardX's event-file writer.

  Tags: ``train/loss``, ``train/grad_norm``, ``train/tokens_per_s`` (steps
  that did not compile), ``val/loss``, ``goodput/goodput``,
  ``goodput/effective_tokens_per_s``, ``ntp/min_tp_degree``,
  ``ntp/global_batch``; the x axis is the step. View with
  ``tensorboard --logdir WORKDIR/tensorboard``.
  """

  TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "val_loss": "val/loss",
          "goodput": "goodput/goodput", "effective_tokens_per_s": "goodput/effective_tokens_per_s",
          "tp_degree": "ntp/min_tp_degree", "global_batch": "ntp/global_batch"}

  def __init__(self, logdir: str):
    from tensorboardX import SummaryWriter  # only runs that ask for TensorBoard load it
    self.logdir = logdir
    self._writer = SummaryWriter(logdir=logdir)

  def write(self, record: dict[str, Any]) -> None:
    step = record["step"]
    for key, tag in self.TAGS.items():
      if key in record:
        self._writer.add_scalar(tag, float(record[key]), step)
    if not record.get("compiled"):
      self._writer.add_scalar("train/tokens_per_s", record["tokens"] / record["step_time_s"], step)

  def close(self) -> None:
    self._writer.close()


def progress_line(record: dict[str, Any], total_steps: int) -> str:
  """``step 10/150 | loss 5.4321 | val 5.5012 | 12,345 tok/s | step 0.210 s | TP degree 7``.

  A step that compiled its programs shows ``compile + step 3.1 s`` instead of
  a rate (compilation is not training speed); ``val`` appears on steps
  that evaluated.
  """
  degree = ",".join(map(str, record.get("tp_degrees", [record["tp_degree"]])))
  val = f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
  if record.get("compiled"):
    speed = f"compile + step {record['step_time_s']:.1f} s"
  else:
    speed = (f"{record['tokens'] / record['step_time_s']:,.0f} tok/s | "
             f"step {record['step_time_s']:.3f} s")
  return (f"step {record['step']:>{len(str(total_steps))}}/{total_steps} | "
          f"loss {record['loss']:.4f}{val} | {speed} | TP degree {degree}")


def read_records(path: str) -> list[dict[str, Any]]:
  """Every row of a ``metrics.jsonl`` file (step records and events), in order."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _rows(path: str) -> list[dict[str, Any]]:
  """``read_records``, or none when the file is not there."""
  return read_records(path) if os.path.exists(path) else []


def read_metrics(path: str) -> list[dict[str, Any]]:
  """The step records of the latest run (since the last ``start`` event), one per step.

  A step that was run again after a resume (it came after the checkpoint
  the run resumed from) appears once, with its latest record.
  """
  rows = read_records(path)
  starts = [i for i, r in enumerate(rows) if r.get("event") == "start"]
  by_step = {}
  for row in rows[starts[-1] + 1 if starts else 0:]:
    if "event" not in row:
      by_step[row["step"]] = row
  return [by_step[s] for s in sorted(by_step)]
