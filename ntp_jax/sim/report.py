"""Rows of results as aligned text tables, CSV and JSON."""

from __future__ import annotations

import csv
import io
import json
import pathlib
from collections.abc import Sequence

FORMATS = ("table", "csv", "json")


def _cell(value) -> str:
  """Text of one cell: floats with 6 significant digits, ``-`` for None."""
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.6g}"
  return str(value)


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  """Aligned plain-text table with a header line.

  Args:
    rows: One mapping per row; missing keys print as ``-``.
    columns: Column names, in order.

  Returns:
    The table, lines joined by newlines, without a trailing newline.
  """
  cells = [[_cell(row.get(c)) for c in columns] for row in rows]
  widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
  lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
  lines.append("  ".join("-" * w for w in widths))
  lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
  return "\n".join(lines)


def format_csv(rows: Sequence[dict], columns: Sequence[str]) -> str:
  """CSV text with a header line."""
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore",
                          lineterminator="\n")
  writer.writeheader()
  writer.writerows(rows)
  return buffer.getvalue()


def format_json(rows: Sequence[dict], columns: Sequence[str]) -> str:
  """JSON list of objects restricted to ``columns``."""
  return json.dumps([{c: row.get(c) for c in columns} for row in rows], indent=1)


def render(rows: Sequence[dict], columns: Sequence[str], fmt: str) -> str:
  """Rows in one of ``FORMATS``.

  Raises:
    ValueError: On an unknown format.
  """
  if fmt == "table":
    return format_table(rows, columns)
  if fmt == "csv":
    return format_csv(rows, columns).rstrip("\n")
  if fmt == "json":
    return format_json(rows, columns)
  raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def write_rows(directory: pathlib.Path, stem: str, rows: Sequence[dict],
               columns: Sequence[str]) -> list[pathlib.Path]:
  """Writes ``stem.csv`` and ``stem.json`` under ``directory`` (created if needed).

  Returns:
    The paths written.
  """
  directory.mkdir(parents=True, exist_ok=True)
  paths = [directory / f"{stem}.csv", directory / f"{stem}.json"]
  paths[0].write_text(format_csv(rows, columns))
  paths[1].write_text(format_json(rows, columns) + "\n")
  return paths
