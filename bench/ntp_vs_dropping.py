"""NTP against DP-DROP on one model and one set of devices, side by side in one process.

  python bench/ntp_vs_dropping.py [--config configs/gpt_small.py] [--steps 5]
                                  [--out docs/bench_ntp.md]

Plans on a 2 x 4 mesh (8 simulated CPU devices unless XLA_FLAGS says
otherwise): healthy; NTP with one failed slot (replica 1 at TP degree 3);
NTP with two failed slots (replica 1 at degree 2), both also with a
constant batch (``ntp.rebalance=constant``: the healthy 16 sequences
spread by degree); DP-DROP (replica 1 removed). For each: sequences and
tokens per step, executed flops per live device from XLA's cost analysis
(per class), the flops that device's own
shard needs (the same step for a TP group whose every slot holds exactly
that device's units; a shared KV group counts as ``1 / degree`` of a group),
and the median step time. Writes a markdown table.
"""

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import progress, simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import emit, load_config  # noqa: E402
from flax import nnx  # noqa: E402

from models.gpt import GPT, GPTConfig, model_layouts  # noqa: E402
from ntp_jax.analysis.cost import class_step_flops, own_shard_flops  # noqa: E402
from ntp_jax.parallel.plan import make_plan  # noqa: E402
from ntp_jax.parallel.programs import build_class_programs  # noqa: E402
from ntp_jax.parallel.step_modes import make_job_step  # noqa: E402
from ntp_jax.training.config import parse_failed  # noqa: E402
from ntp_jax.training.optim import make_optimizer  # noqa: E402

SCENARIOS = [  # (name, ntp.failed, ntp.rebalance)
    ("healthy", "", "proportional"),
    ("NTP, 1 slot failed", "1:2", "proportional"),
    ("NTP, 1 slot failed, constant batch", "1:2", "constant"),
    ("NTP, 2 slots failed", "1:1,1:2", "proportional"),
    ("NTP, 2 slots failed, constant batch", "1:1,1:2", "constant"),
    ("DP-DROP, 1 slot failed", "1:0,1:1,1:2,1:3", "proportional"),
]
TP, DP = 4, 2


def build(cfg, config, failed, *, tp=TP, dp=DP, batch_size=None, rebalance="proportional"):
  plan = make_plan(functools.partial(model_layouts, cfg), tp=tp, dp=dp,
                   failed=parse_failed(failed, dp, tp),
                   batch_size=batch_size or config.train.batch_size, rebalance=rebalance)
  optimizer = make_optimizer(config.train)
  programs = build_class_programs(
      plan, lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(0)), optimizer,
      config.train.clip_norm, plan.global_batch * config.train.seq_len,
      jax.devices()[:tp * dp])
  return plan, make_job_step(plan, programs)


def measure(cfg, config, name, failed, rebalance, steps, cache):
  plan, job = build(cfg, config, failed, rebalance=rebalance)
  seq = config.train.seq_len
  rng = np.random.default_rng(0)
  times = []
  for _ in range(steps + 1):  # the first compiles
    batch = rng.integers(0, cfg.vocab_size, (plan.global_batch, seq + 1), dtype=np.int32)
    start = time.perf_counter()
    float(job(batch)["loss"])
    times.append(time.perf_counter() - start)
  worst_vs_own, worst_device = 0.0, ""
  flops = []
  for program in job.programs:
    c = program.replica_class
    executed = class_step_flops(job, program, seq)
    flops.append(executed)
    for replica, slots in zip(c.replicas, c.live_slots):
      for position, slot in enumerate(slots):
        need = own_shard_flops(cfg, c, position, config.train.seq_len, cache,
                               lambda uniform, degree, share: build(
                                   uniform, config, "", tp=degree, dp=1, batch_size=share)[1])
        ratio = executed / need
        if ratio > worst_vs_own:
          worst_vs_own, worst_device = ratio, f"replica {replica} slot {slot}"
  return dict(name=name, failed=failed or "-", live=plan.live_devices,
              sequences=plan.global_batch, tokens=plan.global_batch * seq,
              flops=flops, degrees=[c.degree for c in plan.classes],
              worst=worst_vs_own, worst_device=worst_device,
              step_s=statistics.median(times[1:]))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/gpt_small.py")
  parser.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up step")
  parser.add_argument("--out", default="", help="write the markdown table here too")
  args = parser.parse_args()
  config = load_config(args.config)
  # Unrolled blocks: XLA's cost analysis counts a scanned loop body once.
  cfg = dataclasses.replace(GPTConfig.from_config(config.model), scan_layers=False)
  cache = {}
  rows = [measure(cfg, config, name, failed, rebalance, args.steps, cache)
          for name, failed, rebalance in progress(SCENARIOS, "scenarios")]
  base = rows[0]
  lines = [
      f"`python bench/ntp_vs_dropping.py --config {args.config} --steps {args.steps}` "
      f"({jax.devices()[0].platform}, {len(jax.devices())} devices, mesh {DP} x {TP}, "
      f"{config.train.seq_len} tokens per sequence)",
      "",
      "| plan | `ntp.failed` | live devices | sequences / step | tokens / step "
      "| tokens vs healthy | TP degree per class | GFLOP / device / step (per class) "
      "| worst device: executed / own shard "
      "| busiest device vs healthy | tokens per busiest-device flop vs healthy "
      "| CPU step time (s) | CPU step time vs healthy |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
        f"| {r['name']} | `{r['failed']}` | {r['live']} | {r['sequences']} | {r['tokens']:,} | "
        f"{r['tokens'] / base['tokens']:.3f} | {', '.join(map(str, r['degrees']))} | "
        f"{', '.join(f'{f / 1e9:.2f}' for f in r['flops'])} | {r['worst']:.3f} "
        f"({r['worst_device']}) | {max(r['flops']) / max(base['flops']):.3f} | "
        f"{r['tokens'] / max(r['flops']) / (base['tokens'] / max(base['flops'])):.3f} | "
        f"{r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} |")
  lines += [
      "",
      "On parallel devices a step lasts as long as its busiest device, so with compute-bound "
      "steps the job's throughput relative to healthy is the 'tokens per busiest-device flop' "
      "column. The CPU step time is measured on simulated devices that share this host's "
      "cores: it tracks the total work of all devices, not the time of parallel GPUs.",
      "",
      "A constant batch (`ntp.rebalance=constant`) keeps the healthy 16 sequences per step and "
      "spreads them over the live replicas in proportion to their degree: the busiest device "
      "works longer, by up to T/t, and the rounding of whole sequences costs the difference "
      "between the two 'tokens per busiest-device flop' figures of each failure.",
  ]
  emit(lines, args.out)


if __name__ == "__main__":
  main()
