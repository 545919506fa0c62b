"""Helpers shared by the benchmarks: simulated devices, load a config file, progress, a table."""

import importlib.util
import os
import sys


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


def progress(items, desc: str):
  """``items`` with a progress bar on stderr (tqdm), so minutes-long runs show where they are."""
  from tqdm import tqdm
  items = list(items)
  return tqdm(items, desc=desc, total=len(items), file=sys.stderr, leave=False)


class Stages:
  """A progress bar over named stages: ``with Stages(4, "recovery") as s: ...; s.next("live")``."""

  def __init__(self, total: int, desc: str):
    from tqdm import tqdm
    self.bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False)

  def next(self, name: str) -> None:
    """Start stage ``name`` (the previous one is done)."""
    if self.bar.n or self.bar.postfix:
      self.bar.update(1)
    self.bar.set_postfix_str(name)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.bar.update(self.bar.total - self.bar.n)
    self.bar.close()
