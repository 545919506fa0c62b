"""Training throughput on GPUs: tokens/s, step time and MFU; NTP against healthy on several GPUs.

  python bench/gpu.py [--steps 10] [--batch B] [--seq S] [--remat full] [--dtype bfloat16]
                      [--configs configs/gpt_small.py,configs/gpt_1b.py] [--out FILE]

On a machine without a GPU it prints one line and exits 0; ``--allow-cpu``
runs the same code paths on the CPU with configs/gpt_tiny.py and 2 steps
(set ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` for the
several-device part).

Single GPU: each config (default gpt_small and gpt_1b) as one TP group of
one slot (tp=1, dp=1), one warm-up step (compilation), then ``--steps``
timed steps on random tokens, each ended by ``jax.block_until_ready``;
the median step time is reported.

Several GPUs (two or more): the first config on tp = number of GPUs (at
most 8), dp = 1, healthy and with slot 1 failed (``ntp.failed="1"``: TP
degree tp - 1). A lone replica keeps its full batch, so both run the same
global batch; with compute-bound steps the ideal NTP/healthy tokens/s ratio
is (tp - 1) / tp.

Model flops per step (PaLM, Chowdhery et al., arXiv:2204.02311, Appendix B):
``6 N D + 12 L H Q T D``, with N the parameters that take part in a
matmul (``models.gpt.count_params`` less the input embedding table, whose
lookup does no matmul, unless it is tied to the output head), D tokens per step, L layers,
H Q = n_heads x head_dim (= d_model in these configs) and T the sequence
length. Rematerialised flops are not counted. MFU = model flops per step /
(step time x live GPUs x peak dense bf16 flops of one GPU); the peak comes
from ``device.device_kind`` (vendor datasheet figures below); an unknown
kind shows "-".

Before building a job the plan's memory is checked from shapes
(``ntp_jax.training.resources.check_footprint``); a plan that does not fit, or an
out-of-memory error from XLA, is reported as a row instead of stopping.
"""

import argparse
import functools
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import numpy as np
from common import emit, load_config
from flax import nnx

from models.gpt import GPT, GPTConfig, count_params, gpt_spec, model_layouts
from ntp_jax.layers import REMAT_POLICIES
from ntp_jax.parallel.plan import make_plan
from ntp_jax.parallel.programs import build_class_programs
from ntp_jax.parallel.step_modes import make_job_step
from ntp_jax.training.config import parse_failed
from ntp_jax.training.optim import make_optimizer
from ntp_jax.training.resources import ResourceError, check_footprint

try:
  from tqdm import tqdm
except ImportError:  # plain progress lines instead
  tqdm = None

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
# Peak dense bf16 flop/s of one device, by a substring of ``device_kind``; the
# first match wins, so specific names come before general ones. Datasheets:
# NVIDIA H100/H200 (SXM), A100, L4; AMD MI300X.
PEAK_BF16 = [
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
    ("L4", 121e12),
    ("MI300X", 1307e12),
]
MAX_TP = 8


def peak_flops(device_kind: str) -> float | None:
  """Peak dense bf16 flop/s of one device of this kind, or None when unknown."""
  for name, flops in PEAK_BF16:
    if name in device_kind:
      return flops
  return None


def model_flops(cfg: GPTConfig, tokens: int, seq_len: int) -> float:
  """Model flops of one training step (PaLM Appendix B): 6 N D + 12 L H Q T D."""
  attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len * tokens
  lookup = 0 if getattr(cfg, "tie_embeddings", False) else cfg.vocab_size * cfg.d_model
  return 6 * (count_params(cfg) - lookup) * tokens + attention


def log(message: str) -> None:
  if tqdm is not None:
    tqdm.write(message, file=sys.stderr)
  else:
    print(message, file=sys.stderr, flush=True)


def is_out_of_memory(error: Exception) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def build(cfg, config, failed, *, tp, devices):
  """The job of ``cfg`` on one TP group of ``tp`` slots (dp=1), as bench/ntp_vs_dropping.py."""
  plan = make_plan(functools.partial(model_layouts, cfg), tp=tp, dp=1,
                   failed=parse_failed(failed, 1, tp),
                   batch_size=config.train.batch_size)
  optimizer = make_optimizer(config.train)
  check_footprint(config, gpt_spec(cfg, config.train.seed), plan, optimizer, devices[:tp], log)
  programs = build_class_programs(
      plan, lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(config.train.seed)), optimizer,
      config.train.clip_norm, plan.global_batch * config.train.seq_len, devices[:tp])
  return plan, make_job_step(plan, programs)


def measure(name, config, *, tp, failed, steps, devices):
  """One row: median step time, tokens/s and MFU, or why it could not run."""
  cfg = GPTConfig.from_config(config.model)
  seq = config.train.seq_len
  row = {"name": name, "tp": tp, "failed": failed or "-", "params": count_params(cfg),
         "seq": seq, "remat": cfg.remat, "dtype": cfg.dtype, "error": ""}
  try:
    plan, job = build(cfg, config, failed, tp=tp, devices=devices)
    rng = np.random.default_rng(0)
    times = []
    steps_iter = range(steps + 1)
    if tqdm is not None:
      steps_iter = tqdm(steps_iter, desc=f"{name} tp={tp} failed={row['failed']}", leave=False,
                        file=sys.stderr)
    for step in steps_iter:
      batch = rng.integers(0, cfg.vocab_size, (plan.global_batch, seq + 1), dtype=np.int32)
      start = time.perf_counter()
      metrics = job(batch)
      jax.block_until_ready((metrics, [p.params for p in job.programs]))
      times.append(time.perf_counter() - start)
      if tqdm is None:
        log(f"{name} tp={tp} failed={row['failed']}: step {step} {times[-1]:.3f} s"
            + (" (warm-up)" if step == 0 else ""))
    step_s = statistics.median(times[1:])
    tokens = plan.global_batch * seq
    peak = peak_flops(devices[0].device_kind)
    mfu = None if peak is None else model_flops(cfg, tokens, seq) / (
        step_s * plan.live_devices * peak)
    return dict(row, live=plan.live_devices, batch=plan.global_batch, step_s=step_s,
                tokens_s=tokens / step_s, compile_s=times[0], mfu=mfu)
  except ResourceError as error:
    return dict(row, error=f"does not fit: {error}")
  except jax.errors.JaxRuntimeError as error:
    if not is_out_of_memory(error):
      raise
    return dict(row, error="out of memory")
  finally:
    job = None  # free this job's device buffers before the next one is built
    gc.collect()


def fmt_mfu(row) -> str:
  return "-" if row.get("mfu") is None else f"{100 * row['mfu']:.1f}%"


def single_table(rows) -> list[str]:
  lines = [
      ("| model | parameters | sequences x tokens | dtype | remat | step time (s) | tokens/s "
       "| MFU | first step incl. compile (s) |"),
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    head = f"| {r['name']} | {r['params'] / 1e6:,.1f}M |"
    if r["error"]:
      lines.append(f"{head} - x {r['seq']} | {r['dtype']} | {r['remat']} | {r['error']} "
                   "| - | - | - |")
      continue
    lines.append(f"{head} {r['batch']} x {r['seq']} | {r['dtype']} | {r['remat']} | "
                 f"{r['step_s']:.4f} | {r['tokens_s']:,.0f} | {fmt_mfu(r)} | "
                 f"{r['compile_s']:.1f} |")
  return lines


def ntp_table(rows, tp) -> list[str]:
  healthy = rows[0]
  lines = [
      ("| plan | `ntp.failed` | live devices (TP degree) | sequences x tokens | step time (s) "
       "| tokens/s | MFU (over live devices) | tokens/s vs healthy | ideal |"),
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    head = f"| {'healthy' if r['failed'] == '-' else 'NTP, slot 1 failed'} | `{r['failed']}` |"
    if r["error"]:
      lines.append(f"{head} - | - | {r['error']} | - | - | - | - |")
      continue
    ratio, ideal = "1.000", "1.000"
    if r is not healthy:
      ratio = "-" if healthy["error"] else f"{r['tokens_s'] / healthy['tokens_s']:.3f}"
      ideal = f"{(tp - 1) / tp:.3f}"
    lines.append(f"{head} {r['live']} | {r['batch']} x {r['seq']} | {r['step_s']:.4f} | "
                 f"{r['tokens_s']:,.0f} | {fmt_mfu(r)} | {ratio} | {ideal} |")
  return lines


def with_overrides(path, args):
  config = load_config(path)
  if args.batch:
    config.train.batch_size = args.batch
  if args.seq:
    config.train.seq_len = args.seq
  if args.remat:
    config.model.remat = args.remat
  config.model.dtype = args.dtype
  return config


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--configs", default="",
                      help="comma-separated config files (default: gpt_small and gpt_1b; "
                      "gpt_tiny with --allow-cpu); the first is used on several GPUs")
  parser.add_argument("--steps", type=int, default=0,
                      help="timed steps after one warm-up step (default 10; 2 with --allow-cpu)")
  parser.add_argument("--batch", type=int, default=0, help="train.batch_size override")
  parser.add_argument("--seq", type=int, default=0, help="train.seq_len override")
  parser.add_argument("--remat", default="", choices=["", *REMAT_POLICIES],
                      help="model.remat override")
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                      help="model.dtype (compute)")
  parser.add_argument("--allow-cpu", action="store_true",
                      help="run on the CPU with tiny sizes (exercises the code paths only)")
  parser.add_argument("--out", default="", help="write the markdown tables here too")
  args = parser.parse_args()

  devices = jax.devices()
  platform = devices[0].platform
  on_gpu = platform in GPU_PLATFORMS
  if not on_gpu and not args.allow_cpu:
    print(f"skipped: no GPU (platform {platform}); run on a GPU machine")
    return
  paths = [p for p in args.configs.split(",") if p] or (
      ["configs/gpt_small.py", "configs/gpt_1b.py"] if on_gpu else ["configs/gpt_tiny.py"])
  steps = args.steps or (10 if on_gpu else 2)
  kind = devices[0].device_kind

  single = [measure(os.path.basename(p).removesuffix(".py"), with_overrides(p, args),
                    tp=1, failed="", steps=steps, devices=devices) for p in paths]
  command = " ".join(["python bench/gpu.py", *sys.argv[1:]])
  lines = [
      (f"`{command}` ({len(devices)} x {kind}, platform {platform}, jax {jax.__version__}, "
       f"{steps} timed steps after one warm-up, median step time)"),
      "",
      "Single device (tp=1, dp=1):",
      "",
      *single_table(single),
  ]
  tp = min(len(devices), MAX_TP)
  if tp >= 2:
    config = with_overrides(paths[0], args)
    name = os.path.basename(paths[0]).removesuffix(".py")
    rows = [measure(name, config, tp=tp, failed=failed, steps=steps, devices=devices)
            for failed in ("", "1")]
    lines += [
        "",
        f"{name} on one TP group of {tp} devices (dp=1), same global batch:",
        "",
        *ntp_table(rows, tp),
    ]
  else:
    lines += ["", "One device only: no NTP comparison."]
  if not on_gpu:
    lines += ["", ("CPU run (--allow-cpu): checks the code paths; the figures say nothing "
                   "about GPUs.")]
  emit(lines, args.out)


if __name__ == "__main__":
  main()
