"""ntp_jax's healthy step against plain GSPMD tensor parallelism, and its degree-7 step.

  python bench/vs_gspmd.py [--config configs/gpt_small.py] [--tp 8] [--pairs 8]
                           [--failed-slot 3] [--out docs/bench_vs_gspmd.md]

The reference is ``bench/gspmd_gpt.py``: the same model written as plain JAX,
weights in ``NamedSharding`` over one TP group, one ``jax.jit`` (what a
MaxText user runs). Both start from the same logical parameters (the GSPMD
side takes ntp_jax's, joined), so the first losses must agree. Per device and
step, from the compiled programs: flops and bytes accessed (XLA's cost
analysis) and the bytes of every all-reduce (read from the optimized HLO,
``ntp_jax.analysis.hlo_collectives``). XLA counts a loop body once, so these
come from unrolled programs at 2 and 3 layers, extended to the model's depth
(``footprint.per_device_flops``). Step times are the scanned programs (what
training runs), timed in pairs in one process, the order alternating, and
reported as the median of the per-pair ratios. The degree-7 step is ntp_jax's
with ``--failed-slot`` of the group lost (the same batch on 7 devices).
Defaults: gpt_small, batch 16 x 256, f32, TP 8 on 8 simulated CPU devices.
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

from common import emit, load_config, progress, simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import gspmd_gpt  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from models.gpt import GPT, GPTConfig, model_layouts  # noqa: E402
from ntp_jax.analysis.cost import flops_of  # noqa: E402
from ntp_jax.analysis.hlo_collectives import collectives, totals  # noqa: E402
from ntp_jax.layers.shard import replica_view, to_logical  # noqa: E402
from ntp_jax.parallel.plan import make_plan  # noqa: E402
from ntp_jax.parallel.programs import build_class_programs  # noqa: E402
from ntp_jax.parallel.step_modes import make_job_step  # noqa: E402
from ntp_jax.parallel.steps import FusedStep, StepSettings  # noqa: E402
from ntp_jax.training.footprint import abstract_program, per_device_flops  # noqa: E402
from ntp_jax.training.optim import make_optimizer  # noqa: E402

MiB = 2**20


def ntp_job(cfg, config, tp, failed):
  plan = make_plan(functools.partial(model_layouts, cfg), tp=tp, dp=1, failed=failed,
                   batch_size=config.train.batch_size)
  programs = build_class_programs(
      plan, lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(config.train.seed)),
      make_optimizer(config.train), config.train.clip_norm,
      plan.global_batch * config.train.seq_len, jax.devices()[:tp])
  return make_job_step(plan, programs)


def ntp_compiled(cfg, config, tp, failed):
  """The compiled fused step of ntp_jax's one class (abstract state: nothing placed)."""
  plan = make_plan(functools.partial(model_layouts, cfg), tp=tp, dp=1, failed=failed,
                   batch_size=config.train.batch_size)
  optimizer = make_optimizer(config.train)
  program, batch = abstract_program(
      plan, plan.classes[0], lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(0)), optimizer,
      config.train.seq_len, jax.devices()[:tp])
  step = FusedStep.build(program.graphdef, program.params, program.opt_state, program.mesh,
                         StepSettings(optimizer, config.train.clip_norm,
                                      plan.global_batch * config.train.seq_len))
  [lowered] = step.lower(program.params, program.opt_state, batch)
  return lowered.compile()


def gspmd_mesh(tp):
  return Mesh(np.asarray(jax.devices()[:tp]).reshape(1, tp), ("dp", gspmd_gpt.TP))


def gspmd_compiled(cfg, config, tp):
  mesh = gspmd_mesh(tp)
  params, opt_state = gspmd_gpt.init_state(cfg, config.train, mesh)
  tokens = config.train.batch_size * config.train.seq_len
  step = gspmd_gpt.make_step(cfg, config.train, mesh, tokens, params, opt_state,
                             scan=cfg.scan_layers)
  batch = jax.ShapeDtypeStruct((config.train.batch_size, config.train.seq_len + 1), np.int32)
  return step.lower(params, opt_state, batch).compile()


def figures(compile_at, n_layers):
  """Per-device flops, bytes accessed and collective totals at ``n_layers``, from unrolled
  programs (``footprint.per_device_flops``: measured at 2 and 3 layers and extended)."""
  @functools.cache
  def measure(n):
    compiled = compile_at(n)
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    return (flops_of(compiled), float(analysis.get("bytes accessed", 0.0)),
            totals(collectives(compiled.as_text())))

  flops, size = per_device_flops(lambda n: measure(n)[:2], n_layers)
  coll = (measure(n_layers)[2] if n_layers <= 3
          else measure(2)[2].scaled(measure(3)[2], n_layers - 2))
  return dict(flops=flops, bytes=size, coll=coll)


def gspmd_params_from(logical):
  """The GSPMD parameter tree from ntp_jax's logical parameters (``to_logical``)."""
  b = logical["blocks"]
  return {"embed": logical["embed"]["embedding"],
          "blocks": {"attn_norm": b["attn_norm"]["scale"], "wq": b["attn"]["wq"],
                     "wk": b["attn"]["wk"], "wv": b["attn"]["wv"], "wo": b["attn"]["wo"],
                     "mlp_norm": b["mlp_norm"]["scale"], "gate": b["mlp"]["gate"]["kernel"],
                     "up": b["mlp"]["up"]["kernel"], "down": b["mlp"]["down"]["kernel"]},
          "final_norm": logical["final_norm"]["scale"], "head": logical["head"]["kernel"]}


def timed(fn):
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def time_pairs(cfg, config, tp, pairs):
  """Median per-pair step-time ratio ntp_jax / GSPMD, each side's median, and both first
  losses (from the same logical parameters and batch)."""
  job = ntp_job(cfg, config, tp, ())
  mesh = gspmd_mesh(tp)
  logical = to_logical(replica_view(job.programs[0].params))
  params = jax.device_put(gspmd_params_from(logical), gspmd_gpt.param_shardings(mesh))
  opt_state = gspmd_gpt.init_optimizer(config.train, params, mesh)
  tokens = config.train.batch_size * config.train.seq_len
  step = gspmd_gpt.make_step(cfg, config.train, mesh, tokens, params, opt_state)
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, cfg.vocab_size, (config.train.batch_size, config.train.seq_len + 1),
                          dtype=np.int32) for _ in range(2)]
  state = [params, opt_state]

  def gspmd(batch):
    state[0], state[1], loss = step(state[0], state[1], batch)
    return loss

  # First step of each (compiles): the same parameters and batch give the same loss.
  losses = (float(job(batches[0])["loss"]), float(gspmd(batches[0])))
  ntp_s, gspmd_s, ratios = [], [], []
  for i in progress(range(pairs), "step pairs"):
    batch = batches[i % 2]
    first, second = (job, gspmd) if i % 2 == 0 else (gspmd, job)
    a = timed(functools.partial(first, batch))
    b = timed(functools.partial(second, batch))
    t_ntp, t_gspmd = (a, b) if i % 2 == 0 else (b, a)
    ntp_s.append(t_ntp)
    gspmd_s.append(t_gspmd)
    ratios.append(t_ntp / t_gspmd)
  return dict(ratio=statistics.median(ratios), ntp_s=statistics.median(ntp_s),
              gspmd_s=statistics.median(gspmd_s), losses=losses,
              spread=(min(ratios), max(ratios)))


def degree_time(cfg, config, tp, failed, steps):
  job = ntp_job(cfg, config, tp, failed)
  rng = np.random.default_rng(0)
  batch = rng.integers(0, cfg.vocab_size, (config.train.batch_size, config.train.seq_len + 1),
                       dtype=np.int32)
  timed(lambda: job(batch)["loss"])
  return statistics.median(timed(lambda: job(batch)["loss"]) for _ in range(steps))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/gpt_small.py")
  parser.add_argument("--tp", type=int, default=8)
  parser.add_argument("--pairs", type=int, default=8, help="timed step pairs (at least 8)")
  parser.add_argument("--failed-slot", type=int, default=3, help="the slot lost at degree tp-1")
  parser.add_argument("--degree-steps", type=int, default=3,
                      help="timed steps of the reduced step (0: flops and bytes only)")
  parser.add_argument("--out", default="", help="write the markdown table here too")
  args = parser.parse_args()
  config = load_config(args.config)
  cfg = GPTConfig.from_config(config.model)
  tp, depth = args.tp, cfg.n_layers
  unrolled = lambda n: dataclasses.replace(cfg, n_layers=n, scan_layers=False)  # noqa: E731
  failed = ((0, args.failed_slot),)
  compilers = {
      "ntp_jax": lambda n: ntp_compiled(unrolled(n), config, tp, ()),
      "GSPMD": lambda n: gspmd_compiled(unrolled(n), config, tp),
      "ntp_jax reduced": lambda n: ntp_compiled(unrolled(n), config, tp, failed),
  }
  found = {name: figures(compilers[name], depth)
           for name in progress(compilers, "compiling unrolled programs")}
  timing = time_pairs(cfg, config, tp, args.pairs)
  reduced_s = degree_time(cfg, config, tp, failed, args.degree_steps) if args.degree_steps else None

  ntp, ref, red = found["ntp_jax"], found["GSPMD"], found["ntp_jax reduced"]
  ar = lambda f: f["coll"].bytes.get("all-reduce", 0)  # noqa: E731
  others = lambda f: sum(v for k, v in f["coll"].bytes.items() if k != "all-reduce")  # noqa: E731
  ideal = tp / (tp - 1)
  lines = [
      f"{args.config}: d_model {cfg.d_model}, {depth} layers, batch "
      f"{config.train.batch_size} x {config.train.seq_len}, {cfg.dtype}, TP {tp}, "
      f"{jax.devices()[0].platform} x {len(jax.devices())}, jax {jax.__version__}; "
      f"{args.pairs} step pairs; per device per step", "",
      "| figure | value |", "|---|---:|",
      f"| ntp_jax / GSPMD: step time (paired median) | {timing['ratio']:.3f} |",
      f"| ntp_jax / GSPMD: step time, pair range | {timing['spread'][0]:.3f} – "
      f"{timing['spread'][1]:.3f} |",
      f"| ntp_jax / GSPMD: flops per device | {ntp['flops'] / ref['flops']:.4f} |",
      f"| ntp_jax / GSPMD: bytes accessed per device | {ntp['bytes'] / ref['bytes']:.4f} |",
      f"| ntp_jax / GSPMD: all-reduce bytes per step | {ar(ntp) / ar(ref):.3f} |",
  ]
  for name, f in (("ntp_jax", ntp), ("GSPMD", ref)):
    lines += [
        f"| {name}: step time s (median) | "
        f"{timing['ntp_s' if name == 'ntp_jax' else 'gspmd_s']:.2f} |",
        f"| {name}: GFLOP per device | {f['flops'] / 1e9:.3f} |",
        f"| {name}: GB accessed per device | {f['bytes'] / 1e9:.3f} |",
        f"| {name}: all-reduce MiB per step | {ar(f) / MiB:.2f} |",
        f"| {name}: all-reduce ops per step | {f['coll'].ops.get('all-reduce', 0)} |",
        f"| {name}: other collectives MiB per step | {others(f) / MiB:.2f} |",
        f"| {name}: collectives over a group of one (ops / MiB) | {f['coll'].singleton_ops} / "
        f"{f['coll'].singleton_bytes / MiB:.2f} |",
    ]
  lines += [
      f"| first loss, ntp_jax / GSPMD (same parameters and batch) | "
      f"{timing['losses'][0]:.6f} / {timing['losses'][1]:.6f} |",
      f"| ntp_jax degree {tp - 1} (slot {args.failed_slot} failed): GFLOP per device | "
      f"{red['flops'] / 1e9:.3f} |",
      f"| ntp_jax degree {tp - 1}: flops / ({tp}/{tp - 1} x healthy) | "
      f"{red['flops'] / (ideal * ntp['flops']):.4f} |",
      f"| ntp_jax degree {tp - 1}: GB accessed per device | {red['bytes'] / 1e9:.3f} |",
      f"| ntp_jax degree {tp - 1}: bytes accessed / ({tp}/{tp - 1} x healthy) | "
      f"{red['bytes'] / (ideal * ntp['bytes']):.4f} |",
      f"| ntp_jax degree {tp - 1}: all-reduce MiB per step | {ar(red) / MiB:.2f} |",
      f"| ntp_jax degree {tp - 1}: other collectives MiB per step | {others(red) / MiB:.2f} |",
      f"| ntp_jax degree {tp - 1}: collectives over a group of one | {red['coll'].singleton_ops} |",
  ]
  if reduced_s is not None:
    lines.append(f"| ntp_jax degree {tp - 1}: step time / healthy step time | "
                 f"{reduced_s / timing['ntp_s']:.3f} |")
  print()
  emit(lines, args.out)


if __name__ == "__main__":
  main()
