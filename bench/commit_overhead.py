"""What steps that commit cost a healthy multi-process job: two trees, runs interleaved.

  python bench/commit_overhead.py --before PATH [--layouts 2x4,8x1] [--config configs/gpt_small.py]
                                  [--steps 12] [--rounds 2]

``--before`` is another checkout of the project (``git worktree add PATH <commit>``); this
one is the ``after``. Each round runs, for each layout ``PxD``, the same recoverable job
(dp=2 tp=4, constant batch, heartbeat 5 s, no checkpoint, no compile ahead) from the
``before`` tree, then from this one, under ``python -m ntp_jax.launch --run-on``, and reads
the step times of ``metrics.jsonl`` (steps 2 and on: past compilation). It prints each
run's median step time and, per layout, after / before of the medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tree: str, layout: str, config: str, steps: int, workdir: str) -> float:
  """The median steady step time (s) of one job from ``tree``."""
  processes, per_process = map(int, layout.split("x"))
  command = [sys.executable, "-m", "ntp_jax.launch", f"--processes={processes}",
             f"--devices-per-process={per_process}", "--run-on", "--", sys.executable,
             "train.py", "--config", config, f"--config.workdir={workdir}",
             "--config.mesh.dp=2", "--config.mesh.tp=4", f"--config.train.steps={steps}",
             "--config.train.eval_every=0", "--config.train.plot=False",
             "--config.checkpoint.every=0", "--config.ntp.rebalance=constant",
             "--config.ntp.precompile=none", "--config.distributed.recoverable=True",
             "--config.distributed.heartbeat_timeout_s=5",
             f"--config.distributed.processes_per_domain={max(1, 4 // per_process)}"]
  # The tree's own package first (an editable install would give this one's).
  env = dict(os.environ, PYTHONPATH=tree)
  done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                        timeout=1800)
  if done.returncode != 0:
    raise RuntimeError(f"{tree} {layout}: exit {done.returncode}\n{done.stderr[-2000:]}")
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  times = [r["step_time_s"] for r in rows if "event" not in r and r["step"] >= 2]
  return float(np.median(times))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--before", required=True, help="the other checkout")
  parser.add_argument("--layouts", default="2x4,8x1")
  parser.add_argument("--config", default="configs/gpt_small.py")
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--rounds", type=int, default=2)
  args = parser.parse_args()
  trees = {"before": os.path.abspath(args.before), "after": ROOT}
  medians: dict[tuple[str, str], list[float]] = {}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(args.rounds):
      for layout in args.layouts.split(","):
        for name, tree in trees.items():
          workdir = os.path.join(tmp, f"{name}-{layout}-{r}")
          step_s = run(tree, layout, args.config, args.steps, workdir)
          medians.setdefault((name, layout), []).append(step_s)
          print(f"round {r} {layout} {name}: median step {step_s:.3f} s", flush=True)
  print(f"\n`python bench/commit_overhead.py --before {args.before} --layouts {args.layouts} "
        f"--config {args.config} --steps {args.steps} --rounds {args.rounds}`\n")
  print("| layout | before (s) | after (s) | after / before |")
  print("|---|---|---|---|")
  for layout in args.layouts.split(","):
    before = float(np.median(medians[("before", layout)]))
    after = float(np.median(medians[("after", layout)]))
    print(f"| {layout} | {before:.3f} | {after:.3f} | {after / before:.3f} |")


if __name__ == "__main__":
  main()
