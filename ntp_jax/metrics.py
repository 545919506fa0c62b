"""Per-step metrics: ``WORKDIR/metrics.jsonl`` and the progress line.

The file is only ever appended to. Besides one record per step it holds
event rows (``{"event": "start" | "resume" | "stop", ...}``): a run that
starts afresh writes ``start``, a resumed run ``resume``; so a workdir keeps
the history of every run, and ``read_metrics`` gives the latest run's steps.
"""

from __future__ import annotations

import json
import os
from typing import Any


class MetricsWriter:
  """Appends JSON objects, one per line, to ``<workdir>/metrics.jsonl``.

  Each line is written whole and flushed, so an interrupted run leaves only
  whole lines.
  """

  def __init__(self, workdir: str):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a", encoding="utf-8")

  def write(self, record: dict[str, Any]) -> None:
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()

  def event(self, name: str, **fields: Any) -> None:
    """An event row: ``{"event": name, **fields}``."""
    self.write({"event": name, **fields})

  def close(self) -> None:
    self._file.close()


def progress_line(record: dict[str, Any], total_steps: int) -> str:
  """``step 10/150 | loss 5.4321 | 12,345 tok/s | step 0.210 s | TP degree 7``."""
  degree = ",".join(map(str, record.get("tp_degrees", [record["tp_degree"]])))
  return (f"step {record['step']:>{len(str(total_steps))}}/{total_steps} | "
          f"loss {record['loss']:.4f} | {record['tokens'] / record['step_time_s']:,.0f} tok/s | "
          f"step {record['step_time_s']:.3f} s | TP degree {degree}")


def read_records(path: str) -> list[dict[str, Any]]:
  """Every row of a ``metrics.jsonl`` file (step records and events), in order."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


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
