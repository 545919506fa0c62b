"""Helpers shared by the benchmarks: simulated devices, load a config file, print a table."""

import importlib.util
import os


def simulate_cpu_devices(count: int = 8) -> None:
  """Run on the CPU with ``count`` simulated devices unless XLA_FLAGS sets a count.

  Must run before JAX is imported.
  """
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


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
