"""Compile time and program size against depth, and per-device memory of each remat policy.

  python bench/compile.py [--config configs/gpt_small.py] [--layers 4,32] [--unrolled]
                          [--remat-layers 32] [--out docs/bench_compile.md]

Part 1 lowers and compiles the training step of one TP group of 8 with
``model.n_layers`` set to each of ``--layers``, scanned (the default model)
and, with ``--unrolled``, unrolled; it prints the seconds to lower, to
compile, and the size of the lowered program (characters of StableHLO), each
also as a ratio to the smallest depth. Part 2 compiles the step at
``--remat-layers`` for every ``model.remat`` policy and prints XLA's memory
analysis per device (temporaries, the peak as in ``ntp_jax.training.footprint``) and
the flops per device per step (cost analysis of the unrolled model at 2 and
3 layers, extended). Abstract shapes only: nothing is allocated, so the
figures are those of the configured batch and sequence length. One process,
8 simulated CPU devices.
"""

import argparse
import dataclasses
import functools
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import emit, load_config, progress, simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from models.gpt import GPT, GPTConfig, model_layouts  # noqa: E402
from ntp_jax.layers import REMAT_POLICIES  # noqa: E402
from ntp_jax.parallel.plan import make_plan  # noqa: E402
from ntp_jax.parallel.steps import FusedStep, StepSettings  # noqa: E402
from ntp_jax.training.footprint import abstract_program, class_footprints, per_device_flops  # noqa: E402
from ntp_jax.training.optim import make_optimizer  # noqa: E402


def plan_of(cfg, config):
  return make_plan(functools.partial(model_layouts, cfg), tp=8, dp=1,
                   batch_size=config.train.batch_size)


def make(cfg):
  return lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(0))


def compile_step(cfg, config):
  """(seconds to lower, seconds to compile, characters of the lowered program)."""
  plan = plan_of(cfg, config)
  optimizer = make_optimizer(config.train)
  program, batch = abstract_program(plan, plan.classes[0], make(cfg), optimizer,
                                    config.train.seq_len, jax.devices())
  step = FusedStep.build(program.graphdef, program.params, program.opt_state, program.mesh,
                         StepSettings(optimizer, config.train.clip_norm,
                                      plan.global_batch * config.train.seq_len))
  start = time.perf_counter()
  [lowered] = step.lower(program.params, program.opt_state, batch)
  lowered_s = time.perf_counter() - start
  start = time.perf_counter()
  lowered.compile()
  return lowered_s, time.perf_counter() - start, len(lowered.as_text())


def depth_table(base, config, depths, unrolled):
  lines = ["| blocks | layers | lower s | compile s | compile / smallest | program chars | "
           "size / smallest |", "|---|---:|---:|---:|---:|---:|---:|"]
  for scan in ([True, False] if unrolled else [True]):
    first = None
    for n in progress(depths, f"{'scanned' if scan else 'unrolled'} depths"):
      cfg = dataclasses.replace(base, n_layers=n, scan_layers=scan)
      lower_s, compile_s, chars = compile_step(cfg, config)
      first = first or (compile_s, chars)
      lines.append(f"| {'scanned' if scan else 'unrolled'} | {n} | {lower_s:.2f} | "
                   f"{compile_s:.2f} | {compile_s / first[0]:.2f} | {chars:,} | "
                   f"{chars / first[1]:.2f} |")
      print(lines[-1], flush=True)
  return lines


def remat_table(base, config, n_layers):
  optimizer = make_optimizer(config.train)
  args = (optimizer, config.train.clip_norm, config.train.seq_len, jax.devices())
  lines = ["| model.remat | temp MiB / device | peak MiB / device | temp / none | "
           "GFLOP / device / step | flops / none |", "|---|---:|---:|---:|---:|---:|"]
  first = None
  for remat in progress(REMAT_POLICIES, "remat policies"):
    cfg = dataclasses.replace(base, n_layers=n_layers, remat=remat)
    plan = plan_of(cfg, config)
    f = class_footprints(plan, make(cfg), *args)[0]

    def flops_at(n, cfg=cfg, plan=plan):
      small = dataclasses.replace(cfg, n_layers=n, scan_layers=False)
      return [x.flops for x in class_footprints(plan, make(small), *args)]

    flops = per_device_flops(flops_at, n_layers)[0]
    first = first or (f.temp, flops)
    lines.append(f"| {remat} | {f.temp / 2**20:.1f} | {f.peak / 2**20:.1f} | "
                 f"{f.temp / first[0]:.3f} | {flops / 1e9:.2f} | {flops / first[1]:.3f} |")
    print(lines[-1], flush=True)
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/gpt_small.py")
  parser.add_argument("--layers", default="4,32", help="depths compiled, comma-separated")
  parser.add_argument("--unrolled", action="store_true", help="also compile unrolled blocks")
  parser.add_argument("--remat-layers", type=int, default=32, help="depth of the remat table")
  parser.add_argument("--out", default="", help="write the markdown tables here too")
  args = parser.parse_args()
  config = load_config(args.config)
  base = GPTConfig.from_config(config.model)
  depths = [int(n) for n in args.layers.split(",")]
  header = [f"{args.config}: d_model {base.d_model}, batch {config.train.batch_size} x "
            f"{config.train.seq_len} tokens, TP 8, {jax.devices()[0].platform}, jax "
            f"{jax.__version__}", ""]
  lines = header + depth_table(base, config, depths, args.unrolled) + [""]
  lines += remat_table(base, config, args.remat_layers)
  print()
  emit(lines, args.out)


if __name__ == "__main__":
  main()
