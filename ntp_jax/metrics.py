"""Per-step metrics: ``WORKDIR/metrics.jsonl`` and the progress line."""

from __future__ import annotations

import json
import os
from typing import Any


class MetricsWriter:
  """Appends one JSON object per step to ``<workdir>/metrics.jsonl`` (truncated on open)."""

  def __init__(self, workdir: str, *, append: bool = False):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._file = open(self.path, "a" if append else "w", encoding="utf-8")

  def write(self, record: dict[str, Any]) -> None:
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()


def progress_line(record: dict[str, Any], total_steps: int) -> str:
  """``step 10/150 | loss 5.4321 | 12,345 tok/s | step 0.210 s | TP degree 7``."""
  degree = ",".join(map(str, record.get("tp_degrees", [record["tp_degree"]])))
  return (f"step {record['step']:>{len(str(total_steps))}}/{total_steps} | "
          f"loss {record['loss']:.4f} | {record['tokens'] / record['step_time_s']:,.0f} tok/s | "
          f"step {record['step_time_s']:.3f} s | TP degree {degree}")


def read_metrics(path: str) -> list[dict[str, Any]]:
  """All records of a ``metrics.jsonl`` file."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
