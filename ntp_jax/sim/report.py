"""Rows of results as aligned text tables, CSV and JSON.

Tables print each kind of quantity one way (``ratio``, ``percent``, ``count``,
``days``); CSV and JSON keep full precision.
"""

from __future__ import annotations

import csv
import io
import json
import pathlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

FORMATS = ("table", "csv", "json")


def ratio(value: float) -> str:
  """A fraction or ratio (shares, availability, failed fraction, power over TDP): 4 decimals."""
  return f"{value:.4f}"


def percent(value: float) -> str:
  """A value already in percent: 2 decimals, the resolution of ``ratio``."""
  return f"{value:.2f}"


def count(value: int) -> str:
  """A count of GPUs, domains or samples, with thousands separators."""
  return f"{value:,}"


def days(value: float) -> str:
  """A duration given in days: 2 decimals and the unit."""
  return f"{value:.2f} days"


def text(value) -> str:
  """Names, indices and pre-formatted lists, as they are."""
  return str(value)


def format_table(rows: Sequence[dict], columns: Mapping[str, Callable[[Any], str]]) -> str:
  """Aligned plain-text table with a header line.

  Args:
    rows: One mapping per row; missing keys and ``None`` print as ``-``.
    columns: Column name to the function that formats its values (``ratio``,
      ``percent``, ``count``, ``text``), in order.

  Returns:
    The table, lines joined by newlines, without a trailing newline.
  """
  cells = [["-" if row.get(c) is None else cell(row[c]) for c, cell in columns.items()]
           for row in rows]
  widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
  lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
  lines.append("  ".join("-" * w for w in widths))
  lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
  return "\n".join(lines)


def format_csv(rows: Sequence[dict], columns: Collection[str]) -> str:
  """CSV text with a header line."""
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore",
                          lineterminator="\n")
  writer.writeheader()
  writer.writerows(rows)
  return buffer.getvalue()


def format_json(rows: Sequence[dict], columns: Collection[str]) -> str:
  """JSON list of objects restricted to ``columns``."""
  return json.dumps([{c: row.get(c) for c in columns} for row in rows], indent=1)


def render(rows: Sequence[dict], columns: Mapping[str, Callable[[Any], str]], fmt: str) -> str:
  """Rows in one of ``FORMATS``; ``columns`` as for ``format_table``.

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
               columns: Collection[str]) -> list[pathlib.Path]:
  """Writes ``stem.csv`` and ``stem.json`` under ``directory`` (created if needed).

  Returns:
    The paths written.
  """
  directory.mkdir(parents=True, exist_ok=True)
  paths = [directory / f"{stem}.csv", directory / f"{stem}.json"]
  paths[0].write_text(format_csv(rows, columns))
  paths[1].write_text(format_json(rows, columns) + "\n")
  return paths
