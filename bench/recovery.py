"""Cost of a failure while training: live recovery from DP peers against restart from a checkpoint.

  python bench/recovery.py [--config configs/gpt_small.py] [--batch 4] [--seq 64]
                           [--goodput-steps 200] [--out docs/bench_recovery.md]

gpt_small on 8 simulated CPU devices as 2 replicas x 4 slots (equal batch
shares), through ``ntp_jax.training.trainer.train``. A failure of replica 0 slot 3
strikes before step 11, with a checkpoint every 10 steps:

- *time to the next productive step*: from the failure until step 11 has
  run on the new plan (plan, state move or restore, any compilation, the
  steps redone since the checkpoint, step 11 itself). Paths: live with the
  plans one failure away compiled ahead (``ntp.precompile=next_failure``;
  the run waits before step 11 until that background compile is done, as a
  failure in a long run comes long after it), live without, restart
  in-process (the checkpoint restored onto the new plan without leaving the
  process, compiled ahead: a lower bound), and restart as a job scheduler
  does it: a new ``train.py`` process resuming from the step-10 checkpoint
  onto the reduced plan (process and JAX start-up, data cache, restore,
  loading or compiling the programs, step 10 redone, step 11), once with a
  cold persistent compilation cache and once with it warm;
- *the live path's parts*: plan, state move, compile on the recovery path
  (``compile_s`` of the ``recovered`` row), first step;
- *the live path against its floors*: its move against a plain ``jax.device_put``
  of the same bytes between two devices; the bytes it copies against the
  minimum for this failure (every element a device of the new plan holds that
  it did not hold before, from the two plans' layouts, ``floors.minimum_bytes``);
  its first step against the new plan's steady step (the median of the next
  four);
- *bytes moved*: bytes the live path copies between devices, against the
  logical state (parameters and both Adam moments);
- *goodput* of a longer run with two failures and one repair, live, with and
  without compiling ahead, and what the background compile costs the steps
  it overlaps (their median step time against the same steps without it).

Batch and sequence are small so that the steps take well under a second on
CPU. Each stage starts with this process's program caches cleared, so no
stage reuses another's compiled programs.
"""

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Stages, simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
from common import emit, load_config  # noqa: E402
from flax import nnx  # noqa: E402
from floors import minimum_bytes, plain_copy_seconds, plan_programs  # noqa: E402

from models.gpt import GPT, GPTConfig, count_params, model_layouts  # noqa: E402
from ntp_jax.parallel.plan import make_plan  # noqa: E402
from ntp_jax.training.config import RunConfig  # noqa: E402
from ntp_jax.training.hooks import Hook  # noqa: E402
from ntp_jax.training.metrics import read_metrics, read_records  # noqa: E402
from ntp_jax.training.optim import make_optimizer  # noqa: E402
from ntp_jax.training.trainer import train  # noqa: E402

FAIL_STEP = 11
STEADY = 4  # steps after the first on the new plan: its steady step is their median
AHEAD = {"ntp.precompile": "next_failure"}
NOT_AHEAD = {"ntp.precompile": "none"}


class WaitForAhead(Hook):
  """Holds step ``wait_before`` until the background compile is done (a failure in a long
  run comes long after it)."""

  def __init__(self, wait_before: int):
    self.wait_before = wait_before
    self.waited = 0.0

  def before_step(self, step, services):
    if step == self.wait_before:
      start = time.perf_counter()
      services.wait_for_compile_ahead()
      self.waited = time.perf_counter() - start
    return []


def fresh_caches():
  """No stage reuses a program another stage compiled in this process (each run's own
  programs live in its ``ProgramCache``, which ends with it)."""
  jax.clear_caches()


def configure(args, workdir, **overrides):
  """The run config; the tokenized data is shared through one cache folder."""
  cache = os.path.join(os.path.dirname(workdir), "data")
  os.makedirs(workdir, exist_ok=True)
  if not os.path.exists(os.path.join(workdir, "data")):
    os.makedirs(cache, exist_ok=True)
    os.symlink(cache, os.path.join(workdir, "data"))
  config = load_config(args.config)
  config.workdir = workdir
  config.mesh.dp, config.mesh.tp = 2, 4
  config.ntp.rebalance = "equal"
  config.train.batch_size, config.train.seq_len = args.batch, args.seq
  config.train.log_every = 50
  config.data.max_corpus_bytes = 2_000_000
  config.checkpoint.every = 10
  config.train.plot = True
  for key, value in overrides.items():
    section, field = key.split(".")
    config[section][field] = value
  return config


def time_to_productive(records, fail_step):
  """Seconds from the failure to the end of ``fail_step`` run on the new plan."""
  rows = records[next(i for i, r in enumerate(records) if r.get("event") == "fail"):]
  seconds, done = 0.0, False
  for row in rows:
    if row.get("event") == "recovered":
      seconds += row["seconds"]
    elif "loss" in row:
      seconds += row["step_time_s"]
      if row["step"] == fail_step:
        done = True
        break
  assert done
  return seconds, next(r for r in rows if r.get("event") == "recovered")


def steady_step(records, fail_step) -> float:
  """Median step time of the ``STEADY`` steps after ``fail_step`` (on the new plan)."""
  return statistics.median(r["step_time_s"] for r in records if "loss" in r
                           and fail_step < r["step"] <= fail_step + STEADY)


def move_minimum(config) -> int:
  """The least bytes the bench's failure needs moved, from the two plans' layouts."""
  cfg = GPTConfig.from_config(config.model)
  optimizer = make_optimizer(RunConfig.from_config(config).train)
  make = lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(0))  # noqa: E731
  layouts = functools.partial(model_layouts, cfg)
  devices = jax.devices()
  plans = [make_plan(layouts, tp=4, dp=2, failed=failed, batch_size=config.train.batch_size,
                     rebalance="equal") for failed in (set(), {(0, 3)})]
  return minimum_bytes(*(plan_programs(p, make, optimizer, devices) for p in plans))


def process_restart(args, base: str) -> tuple[float, float]:
  """Seconds from launching ``train.py`` on the reduced plan, resuming the step-10
  checkpoint, to the end of step ``FAIL_STEP``: ``(cold, warm)`` persistent compilation
  cache (the warm run finds what the cold one compiled)."""
  workdir = os.path.join(base, "process")
  train(configure(args, workdir, **{"train.steps": 10}), log=lambda *_: None)
  cache = os.path.join(base, "process_compile_cache")
  seconds = []
  for name in ("cold", "warm"):
    copy = os.path.join(base, f"process_{name}")
    shutil.copytree(workdir, copy, symlinks=True)  # each resumes the same step-10 checkpoint
    command = [sys.executable, os.path.join(ROOT, "train.py"), "--config", args.config,
               f"--config.workdir={copy}", "--config.mesh.dp=2", "--config.mesh.tp=4",
               "--config.ntp.rebalance=equal", f"--config.train.batch_size={args.batch}",
               f"--config.train.seq_len={args.seq}", "--config.data.max_corpus_bytes=2000000",
               "--config.checkpoint.every=10", f"--config.train.steps={FAIL_STEP + 1}",
               "--config.ntp.failed=0:3", "--config.train.plot=False",
               f"--config.compile.cache_dir={cache}"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",
                                                             "JAX_COMPILATION_CACHE_DIR")}
    start = time.time()
    subprocess.run(command, check=True, capture_output=True, env=env, cwd=ROOT)
    record = next(r for r in read_metrics(os.path.join(copy, "metrics.jsonl"))
                  if r["step"] == FAIL_STEP)
    seconds.append(record["time"] - start)
  return seconds[0], seconds[1]


def overlap_cost(ahead_records, plain_records) -> tuple[float, int]:
  """Median step time of the steps a background compile overlapped, over the same steps'
  in the run without it (neither compiling its own programs); and how many steps."""
  plain = {r["step"]: r["step_time_s"] for r in plain_records
           if "loss" in r and not r.get("compiled")}
  pairs = [(r["step_time_s"], plain[r["step"]]) for r in ahead_records
           if r.get("precompiling") and not r.get("compiled") and r["step"] in plain]
  if not pairs:
    return float("nan"), 0
  return (statistics.median(a for a, _ in pairs) / statistics.median(b for _, b in pairs),
          len(pairs))


def goodput_of(result) -> tuple[float, float]:
  """(goodput over the whole wall time, effective tokens per second at the last step)."""
  last = [r for r in read_metrics(result.metrics_path) if "effective_tokens_per_s" in r][-1]
  return (result.goodput["productive"] / sum(result.goodput.values()),
          last["effective_tokens_per_s"])


def recovery_compile(result) -> float:
  """Seconds compiled on the recovery paths of a run (its ``recovered`` rows)."""
  return sum(r["compile_s"] for r in read_records(result.metrics_path)
             if r.get("event") == "recovered")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_small.py"))
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--goodput-steps", type=int, default=200)
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  base = tempfile.mkdtemp(prefix="bench_recovery_")
  quiet = dict(log=lambda *_: None)
  fail = {"ntp.fail_at": f"{FAIL_STEP}@0:3", "train.steps": FAIL_STEP + 2}
  steps = args.goodput_steps
  events = {"ntp.fail_at": f"{steps // 4}@0:3,{3 * steps // 5}@1:1",
            "ntp.repair_at": f"{steps // 2}@0:3", "train.steps": steps}
  with Stages(8, "recovery bench") as stages:
    stages.next("live, not compiled ahead")
    fresh_caches()
    plain = train(configure(args, os.path.join(base, "live_plain"), **fail, **NOT_AHEAD),
                  **quiet)
    plain_s, plain_event = time_to_productive(read_records(plain.metrics_path), FAIL_STEP)
    stages.next("live, compiled ahead")
    fresh_caches()
    live = train(configure(args, os.path.join(base, "live"), **AHEAD,
                           **{**fail, "train.steps": FAIL_STEP + 1 + STEADY}), **quiet,
                 hooks=[WaitForAhead(FAIL_STEP)])
    live_s, live_event = time_to_productive(read_records(live.metrics_path), FAIL_STEP)
    stages.next("restart in-process, compiled ahead")
    fresh_caches()
    restart = train(configure(args, os.path.join(base, "restart"), **fail, **AHEAD,
                              **{"ntp.recovery": "restart"}), **quiet,
                    hooks=[WaitForAhead(FAIL_STEP)])
    restart_s, restart_event = time_to_productive(read_records(restart.metrics_path),
                                                  FAIL_STEP)
    stages.next("restart as a new process, cold and warm cache")
    fresh_caches()
    process_cold_s, process_s = process_restart(args, base)
    stages.next(f"{steps}-step goodput run, not compiled ahead")
    fresh_caches()
    long_plain = train(configure(args, os.path.join(base, "goodput_plain"), **events,
                                 **NOT_AHEAD), **quiet)
    stages.next(f"{steps}-step goodput run, compiled ahead")
    fresh_caches()
    long_run = train(configure(args, os.path.join(base, "goodput"), **events, **AHEAD),
                     **quiet)
  config = configure(args, os.path.join(base, "live"))
  logical = 3 * 4 * count_params(GPTConfig.from_config(config.model))  # f32 params + 2 moments
  copied = live_event["copied_bytes"]
  copy_s = plain_copy_seconds(copied, jax.devices()[0], jax.devices()[1])
  least = move_minimum(config)
  steady = steady_step(read_records(live.metrics_path), FAIL_STEP)
  buckets = long_run.goodput
  goodput, effective = goodput_of(long_run)
  plain_goodput, plain_effective = goodput_of(long_plain)
  overlap, overlapped = overlap_cost(long_run.records, long_plain.records)
  parts = ", ".join(f"{name} {live_event[key]:.2f} s" for name, key in (
      ("plan", "plan_s"), ("move", "move_s"), ("of it the state's own", "transfer_s"),
      ("compile", "compile_s"), ("first step", "first_step_s")))
  lines = [f"`python bench/recovery.py --config {os.path.relpath(args.config, ROOT)} "
           f"--batch {args.batch} --seq {args.seq} --goodput-steps {steps}` "
           f"({jax.devices()[0].platform}, 8 devices, mesh 2 x 4, "
           f"{config.train.batch_size} x {config.train.seq_len} tokens per step)", "",
           "| figure | value |", "|---|---|",
           f"| live: failure to next productive step (plan, move from peers, compile, step "
           f"{FAIL_STEP}), compiled ahead | {live_s:.2f} s |",
           f"| live: compile on the recovery path | {live_event['compile_s']:.1f} s |",
           f"| live: its parts | {parts} |",
           f"| live, not compiled ahead: failure to next productive step | {plain_s:.2f} s |",
           f"| live, not compiled ahead: compile on the recovery path | "
           f"{plain_event['compile_s']:.1f} s |",
           f"| compiled ahead before the failure: programs, background wall time | "
           f"{live.compiled_ahead[0]}, {live.compiled_ahead[1]:.1f} s |",
           f"| restart in-process: failure to next productive step (restore step 10, "
           f"redo step 10, step {FAIL_STEP}), compiled ahead | {restart_s:.2f} s |",
           f"| restart in-process: compile on the recovery path | "
           f"{restart_event['compile_s']:.1f} s |",
           f"| restart as a new process (start-up, restore step 10, load or compile, redo "
           f"step 10, step {FAIL_STEP}): warm / cold compilation cache | "
           f"{process_s:.2f} s / {process_cold_s:.2f} s |",
           f"| live / restart in-process | {live_s / restart_s:.2f} |",
           f"| live / restart as a new process: warm / cold cache | {live_s / process_s:.2f} / "
           f"{live_s / process_cold_s:.2f} |",
           f"| live: steps redone | {live.redone_steps} |",
           f"| restart: steps redone | {restart.redone_steps} |",
           f"| live: its move / a plain device_put of the same {copied / 1e6:.1f} MB (fastest of "
           f"3: {copy_s:.3f} s) | {live_event['move_s'] / copy_s:.1f} |",
           f"| live: bytes copied / the minimum for this failure ({least / 1e6:.1f} MB, from "
           f"the two plans' layouts) | {copied / least:.2f} |",
           f"| live: first step / steady step on the new plan (median of the next {STEADY}: "
           f"{steady:.2f} s) | {live_event['first_step_s'] / steady:.2f} |",
           f"| live: bytes copied between devices | {copied / 1e6:.1f} MB |",
           f"| logical state (parameters + 2 Adam moments, f32) | {logical / 1e6:.1f} MB |",
           f"| copied / logical | {live_event['copied_bytes'] / logical:.2f} |",
           f"| {steps}-step run, fail {events['ntp.fail_at']}, repair "
           f"{events['ntp.repair_at']}: goodput, compiled ahead / not | {goodput:.3f} / "
           f"{plain_goodput:.3f} |",
           f"| its effective_tokens_per_s, compiled ahead / not | {effective:.0f} / "
           f"{plain_effective:.0f} |",
           "| its wall time by bucket, compiled ahead | " + ", ".join(
               f"{k} {v:.1f} s" for k, v in buckets.items() if v > 0) + " |",
           "| its wall time by bucket, not compiled ahead | " + ", ".join(
               f"{k} {v:.1f} s" for k, v in long_plain.goodput.items() if v > 0) + " |",
           f"| its compile on the recovery paths, compiled ahead / not | "
           f"{recovery_compile(long_run):.1f} s / {recovery_compile(long_plain):.1f} s |",
           f"| its programs compiled ahead, background wall time | {long_run.compiled_ahead[0]}, "
           f"{long_run.compiled_ahead[1]:.1f} s |",
           f"| step time while compiling ahead / the same steps without ({overlapped} steps, "
           f"medians) | {overlap:.2f} |",
           f"| its programs | {long_run.cache[0]} cache hit(s), {long_run.cache[1]} "
           "compiled |"]
  emit(lines, args.out)


if __name__ == "__main__":
  main()
