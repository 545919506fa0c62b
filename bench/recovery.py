"""Cost of a failure while training: live recovery from DP peers against restart from a checkpoint.

  python bench/recovery.py [--config configs/gpt_small.py] [--batch 4] [--seq 64]
                           [--goodput-steps 200] [--out docs/bench_recovery.md]

gpt_small on 8 simulated CPU devices as 2 replicas x 4 slots (equal batch
shares), through ``ntp_jax.train.trainer.train``. A failure of replica 0 slot 3
strikes before step 11, with a checkpoint every 10 steps:

- *time to the next productive step*: from the failure until step 11 has
  run on the new plan (reconfiguration or restore, compilation of the new
  programs, the steps redone since the checkpoint, step 11 itself). Three
  paths: live (in the running process), restart in-process (the checkpoint
  restored onto the new plan without leaving the process: a lower bound), and
  restart as a job scheduler does it: a new ``train.py`` process resuming
  from the step-10 checkpoint onto the reduced plan (process and JAX
  start-up, data cache, restore, compilation, step 10 redone, step 11);
- *bytes moved*: bytes the live path copies between devices, against the
  logical state (parameters and both Adam moments);
- *goodput* of a longer run with two failures and one repair, live.

Batch and sequence are small so that the steps take well under a second on CPU.
"""

import argparse
import os
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

from models.gpt import GPTConfig, count_params  # noqa: E402
from ntp_jax.train.metrics import read_metrics, read_records  # noqa: E402
from ntp_jax.train.trainer import train  # noqa: E402

FAIL_STEP = 11


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


def process_restart(args, base: str) -> float:
  """Seconds from launching ``train.py`` on the reduced plan, resuming the step-10
  checkpoint, to the end of step ``FAIL_STEP``."""
  workdir = os.path.join(base, "process")
  train(configure(args, workdir, **{"train.steps": 10}), log=lambda *_: None)
  command = [sys.executable, os.path.join(ROOT, "train.py"), "--config", args.config,
             f"--config.workdir={workdir}", "--config.mesh.dp=2", "--config.mesh.tp=4",
             "--config.ntp.rebalance=equal", f"--config.train.batch_size={args.batch}",
             f"--config.train.seq_len={args.seq}", "--config.data.max_corpus_bytes=2000000",
             "--config.checkpoint.every=10", f"--config.train.steps={FAIL_STEP + 1}",
             "--config.ntp.failed=0:3", "--config.train.plot=False"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  start = time.time()
  subprocess.run(command, check=True, capture_output=True, env=env, cwd=ROOT)
  record = next(r for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))
                if r["step"] == FAIL_STEP)
  return record["time"] - start


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
  with Stages(4, "recovery bench") as stages:
    stages.next("live")
    live = train(configure(args, os.path.join(base, "live"), **fail), **quiet)
    live_s, live_event = time_to_productive(read_records(live.metrics_path), FAIL_STEP)
    stages.next("restart in-process")
    restart = train(configure(args, os.path.join(base, "restart"), **fail,
                              **{"ntp.recovery": "restart"}), **quiet)
    restart_s, restart_event = time_to_productive(read_records(restart.metrics_path),
                                                  FAIL_STEP)
    stages.next("restart as a new process")
    process_s = process_restart(args, base)
    stages.next(f"{steps}-step goodput run")
    long_run = train(configure(args, os.path.join(base, "goodput"), **events), **quiet)
  config = configure(args, os.path.join(base, "live"))
  logical = 3 * 4 * count_params(GPTConfig.from_config(config.model))  # f32 params + 2 moments
  buckets = long_run.goodput
  wall = sum(buckets.values())
  lines = [f"`python bench/recovery.py --config {os.path.relpath(args.config, ROOT)} "
           f"--batch {args.batch} --seq {args.seq} --goodput-steps {steps}` "
           f"({jax.devices()[0].platform}, 8 devices, mesh 2 x 4, "
           f"{config.train.batch_size} x {config.train.seq_len} tokens per step)", "",
           "| figure | value |", "|---|---|",
           f"| live: failure to next productive step (plan, move from peers, compile, step "
           f"{FAIL_STEP}) | {live_s:.2f} s |",
           f"| restart in-process: failure to next productive step (restore step 10, compile, "
           f"redo step 10, step {FAIL_STEP}) | {restart_s:.2f} s |",
           f"| restart as a new process (start-up, restore step 10, compile, redo step 10, "
           f"step {FAIL_STEP}) | {process_s:.2f} s |",
           f"| live / restart in-process | {live_s / restart_s:.2f} |",
           f"| live / restart as a new process | {live_s / process_s:.2f} |",
           f"| live: steps redone | {live['redone_steps']} |",
           f"| restart: steps redone | {restart['redone_steps']} |",
           f"| live: bytes copied between devices | {live_event['copied_bytes'] / 1e6:.1f} MB |",
           f"| logical state (parameters + 2 Adam moments, f32) | {logical / 1e6:.1f} MB |",
           f"| copied / logical | {live_event['copied_bytes'] / logical:.2f} |",
           f"| {steps}-step run, fail {events['ntp.fail_at']}, repair "
           f"{events['ntp.repair_at']}: goodput | {buckets['productive'] / wall:.3f} |",
           "| its wall time by bucket | " + ", ".join(
               f"{k} {v:.1f} s" for k, v in buckets.items() if v > 0) + " |",
           f"| its programs | {long_run.cache[0]} cache hit(s), {long_run.cache[1]} "
           "compiled |"]
  emit(lines, args.out)


if __name__ == "__main__":
  main()
