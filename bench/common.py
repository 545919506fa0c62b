"""Helpers shared by the benchmarks: load a config file, print and save a table."""

import importlib.util


def load_config(path: str):
  """``get_config()`` of a config file given by path (as ``train.py --config`` takes it)."""
  spec = importlib.util.spec_from_file_location("bench_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def emit(lines: list[str], out: str = "") -> None:
  """Print a markdown table and, when ``out`` is set, write it there too."""
  table = "\n".join(lines)
  print(table)
  if out:
    with open(out, "w", encoding="utf-8") as f:
      f.write(table + "\n")
