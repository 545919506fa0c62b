"""Where a dry run's time goes: tracing, lowering and XLA's compile, per jitted function.

  python bench/dry_run_time.py [--config configs/gpt_70b.py] [--config.FIELD=VALUE ...]

Runs the config's dry run (``--config.dry_run=True``; the config and its overrides as
``train.py`` takes them, default ``configs/gpt_70b.py``) in this process with no compilation
cache (``compile.cache_dir=none``) and a temporary workdir, so every program is compiled and
nothing is left behind, and listens to JAX's compile events (``jax.monitoring``:
``jaxpr_trace_duration``, ``jaxpr_to_mlir_module_duration``, ``backend_compile_duration``,
each naming its function). Prints, per function name, the programs XLA compiled and the
seconds spent tracing, lowering and compiling them; then the totals against the run's wall
time (the rest: Python, shape inference, the memory plan's own work). A trace inside another
counts in both, so tracing has no total. Run it alone: a second process on the same cores
slows every figure.
"""

import collections
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402
from common import emit, simulate_cpu_devices  # noqa: E402

import train  # noqa: E402  (its --config flag and its parsing)

DEFAULT_CONFIG = os.path.join(ROOT, "configs", "gpt_70b.py")
EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}


def parse(argv: list[str]) -> list[str]:
  """``train.py``'s parsing (one line and exit status 2 for a mistake), its config defaulted."""
  from ntp_jax.training.cli import config_path
  if config_path(argv) is None:
    argv = [argv[0], "--config", DEFAULT_CONFIG, *argv[1:]]
  sys.argv = argv  # ml_collections reads the overrides from sys.argv
  return train.parse_flags(argv)


def main(argv):
  del argv  # parse refuses left-over arguments
  config = train.CONFIG.value
  config.dry_run = True
  config.compile.cache_dir = "none"
  config.workdir = tempfile.mkdtemp(prefix="dry_run_time_")
  simulate_cpu_devices(config.mesh.dp * config.mesh.tp)

  import jax

  from ntp_jax.training.config import RunConfig
  from ntp_jax.training.trainer import train as run_training

  seconds = collections.defaultdict(collections.Counter)  # function -> phase -> seconds
  compiled = collections.Counter()  # function -> programs XLA compiled

  def listen(event, duration, fun_name="?", **_):
    if event in EVENTS:
      # Lowering and compiling name the module (``jit(f)``), tracing the function (``f``).
      name = fun_name[4:-1] if fun_name.startswith("jit(") else fun_name
      seconds[name][EVENTS[event]] += duration
      if EVENTS[event] == "compile":
        compiled[name] += 1

  jax.monitoring.register_event_duration_secs_listener(listen)
  start = time.perf_counter()
  try:
    run_training(RunConfig.from_config(config), log=lambda *_: None)
  finally:
    shutil.rmtree(config.workdir, ignore_errors=True)
  wall = time.perf_counter() - start

  rows = sorted(seconds.items(), key=lambda kv: -kv[1]["compile"])
  lines = ["| function | programs compiled | trace s | lower s | compile s |",
           "|---|---:|---:|---:|---:|"]
  for name, phase in rows:
    if phase["compile"] or phase["lower"] or phase["trace"] >= 0.5:
      lines.append(f"| `{name}` | {compiled[name]} | {phase['trace']:.1f} | "
                   f"{phase['lower']:.1f} | {phase['compile']:.1f} |")
  totals = {p: sum(phase[p] for phase in seconds.values()) for p in ("lower", "compile")}
  lines.append(f"| all ({sum(compiled.values())} programs) | | | {totals['lower']:.1f} | "
               f"{totals['compile']:.1f} |")
  emit(lines)
  print(f"wall {wall:.1f} s: XLA's compile {totals['compile'] / wall:.0%}, lowering "
        f"{totals['lower'] / wall:.0%}, the rest (tracing, shape inference, Python) "
        f"{1 - (totals['compile'] + totals['lower']) / wall:.0%}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse)
