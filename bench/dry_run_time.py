"""Where a dry run's time goes: tracing, lowering and XLA's compile, per jitted function.

  python bench/dry_run_time.py [--config configs/gpt_70b.py] [--set train.microbatches=2 ...]

Runs the config's dry run (``--config.dry_run=True``) in this process with no compilation
cache (``compile.cache_dir=none``), so every program is compiled, and listens to JAX's
compile events (``jax.monitoring``: ``jaxpr_trace_duration``, ``jaxpr_to_mlir_module_duration``,
``backend_compile_duration``, each naming its function). Prints, per function name, the
programs XLA compiled and the seconds spent tracing, lowering and compiling them; then the
totals against the run's wall time (the rest: Python, shape inference, the memory plan's
own work). Nested traces (a jit inside a jit) count in both, so the tracing column adds up
to more than the tracing done. Run it alone: a second process on the same cores slows
every figure.
"""

import argparse
import collections
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import emit, load_config, simulate_cpu_devices  # noqa: E402

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_70b.py"))
  parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                      help="config overrides, e.g. train.microbatches=2")
  args = parser.parse_args()
  config = load_config(args.config)
  for item in args.set:
    field, value = item.split("=", 1)
    section, name = field.split(".")
    config[section][name] = type(config[section][name])(value)
  config.dry_run = True
  config.compile.cache_dir = "none"
  simulate_cpu_devices(config.mesh.dp * config.mesh.tp)

  import jax

  from ntp_jax.training.config import RunConfig
  from ntp_jax.training.trainer import train

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
  train(RunConfig.from_config(config), log=lambda *_: None)
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
  main()
