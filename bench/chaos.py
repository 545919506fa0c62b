"""Fault injection: a process SIGKILLed from outside at a random moment, survived or not.

  python bench/chaos.py [--layouts 8x1,4x2,2x4] [--trials 10] [--steps 30] [--window 10:20]
                        [--victims nonzero|any] [--pair] [--set train.optimizer_sharding=zero1 ...]

Each layout ``PxD`` runs gpt_tiny (dp=2 tp=4, ``distributed.recoverable``,
``ntp.rebalance=constant``, heartbeat 5 s, no periodic checkpoint, the plans
one loss away compiled ahead before each step: ``tests/programs/train_with_hooks.py``
with ``NTP_JAX_WAIT_FOR_AHEAD=1``) as P processes of D CPU devices under
``python -m ntp_jax.launch --run-on``. A trial waits for step ``window[0]``'s row,
then SIGKILLs one process chosen at random (``--victims any``: process 0
among them) after a delay drawn uniformly over ``window`` steps' time, so the
kill lands inside a step, its votes, a recovery or between steps as chance
has it. ``--pair``: a second process, of the other replica and holding other slots (so
every shard unit keeps a live copy), 1 s later.

Per trial it prints: survived (every step 0..steps-1 has a loss, the job
exits 0, no process but the killed ones ended early, and the losses equal the
healthy one-process run's to 1e-5 relative), steps redone, seconds from the kill
to the loss being known (the ``process_lost`` row) and to the end of the next
productive step, and the phase the step was in when its collectives raised
(from the survivors' line).
A summary table per layout follows. The one-process reference runs first.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEARTBEAT_S = 5
RUNNING: list[subprocess.Popen] = []  # the launcher of the trial in progress


def _stop_running(*_) -> None:
  """The bench is stopped: so is the trial's job (its launcher's session), then the bench."""
  for launcher in RUNNING:
    stop_job(launcher)
  sys.exit(1)


def stop_job(launcher: subprocess.Popen) -> None:
  """SIGKILL the launcher's children (each in a session of its own), then the launcher."""
  for pid in children_by_process(launcher.pid).values():
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  try:
    os.killpg(launcher.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def base_args(workdir: str, steps: int, extra: list[str]) -> list[str]:
  return ["train.py", "--config", "configs/gpt_tiny.py", f"--config.workdir={workdir}",
          "--config.mesh.dp=2", "--config.mesh.tp=4", f"--config.train.steps={steps}",
          "--config.train.log_every=1", "--config.train.eval_every=0",
          "--config.train.plot=False", "--config.checkpoint.every=0",
          "--config.ntp.rebalance=constant", *[f"--config.{kv}" for kv in extra]]


def losses_of(workdir: str) -> tuple[dict[int, float], list[dict]]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: (r["loss"], r["time"]) for r in rows if "event" not in r}, rows


def children_by_process(launcher: int) -> dict[int, int]:
  """``NTP_JAX_PROCESS_ID -> pid`` of the launcher's children (read from /proc)."""
  found = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
      if parent != launcher:
        continue
      with open(f"/proc/{entry}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
      found[int(env[b"NTP_JAX_PROCESS_ID"])] = int(entry)
    except (OSError, KeyError, ValueError, IndexError):
      continue
  return found


def trial(layout: str, index: int, args, reference: dict[int, float], rng: random.Random
          ) -> dict:
  processes, per_process = map(int, layout.split("x"))
  workdir = os.path.join(args.workdir, f"{layout}-{index}")
  subprocess.run(["rm", "-rf", workdir], check=True)
  extra = ["distributed.recoverable=True", f"distributed.heartbeat_timeout_s={HEARTBEAT_S}",
           f"distributed.processes_per_domain={max(1, 4 // per_process)}",
           "ntp.precompile=next_failure", *args.set]
  # The test program's hook waits before each step for the compile ahead (the plans one loss
  # away), as in a long run whose failures come long after it has finished.
  program = ["tests/programs/train_with_hooks.py", *base_args(workdir, args.steps, extra)[1:]]
  command = [sys.executable, "-m", "ntp_jax.launch", f"--processes={processes}",
             f"--devices-per-process={per_process}", "--run-on", "--", sys.executable, *program]
  launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env=dict(os.environ, NTP_JAX_WAIT_FOR_AHEAD="1"))
  RUNNING.append(launcher)  # stopped by id if this bench is stopped
  lines: list[tuple[float, str]] = []
  reader = threading.Thread(target=lambda: lines.extend(
      (time.time(), line.rstrip()) for line in launcher.stdout), daemon=True)
  reader.start()
  lo, hi = args.window
  rows = re.compile(r"^\[0\] step +(\d+)/\d+ \| loss")
  deadline = time.time() + args.trial_timeout
  seen: dict[int, float] = {}
  kills: list[tuple[int, float]] = []
  while time.time() < deadline and launcher.poll() is None:
    for at, line in list(lines):
      m = rows.match(line)
      if m:
        seen.setdefault(int(m.group(1)), at)
    if lo in seen:
      break
    time.sleep(0.05)
  if lo in seen:
    steady = [seen[s] - seen[s - 1] for s in range(2, lo + 1) if s in seen and s - 1 in seen]
    step_s = float(np.median(steady)) if steady else 1.0
    time.sleep(rng.uniform(0, (hi - lo) * step_s))
    pids = children_by_process(launcher.pid)
    candidates = sorted(p for p in pids if args.victims == "any" or p != 0)
    victim = rng.choice(candidates)
    os.kill(pids[victim], signal.SIGKILL)
    kills.append((victim, time.time()))
    lines.append((kills[-1][1], f"[bench] SIGKILL process {victim}"))
    if args.pair:  # a process of the other replica, holding other slots, 1 s later
      time.sleep(1.0)
      per_replica = max(1, 4 // per_process)
      # Other slots: every shard unit keeps a live copy (with the same slots of both
      # replicas gone, only a checkpoint holds their units).
      others = [p for p in candidates if p // per_replica != victim // per_replica
                and p % per_replica != victim % per_replica]
      if others:
        second = rng.choice(others)
        os.kill(pids[second], signal.SIGKILL)
        kills.append((second, time.time()))
  try:
    status = launcher.wait(timeout=max(1.0, deadline - time.time()))
  except subprocess.TimeoutExpired:
    stop_job(launcher)
    status = "timeout"
  reader.join(timeout=5)
  RUNNING.remove(launcher)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "output.log"), "w") as f:  # the whole job's output
    f.write("\n".join(f"{at:.3f} {line}" for at, line in lines) + "\n")
  out = {"layout": layout, "trial": index, "status": status,
         "victims": [v for v, _ in kills]}
  try:
    got, records = losses_of(workdir)
  except OSError:
    got, records = {}, []
  complete = sorted(got) == list(range(args.steps))
  equal = complete and np.allclose([got[s][0] for s in range(args.steps)],
                                   [reference[s] for s in range(args.steps)], rtol=1e-5)
  # Only the processes killed may end early: a survivor that stopped is a process lost too.
  exits = [re.search(r"\[launch\] process (\d+) exited with status (\d+)", line)
           for _, line in lines]
  out["stopped"] = sorted(int(m.group(1)) for m in exits
                          if m and int(m.group(1)) not in out["victims"])
  out["survived"] = bool(status == 0 and equal and not out["stopped"])
  lost = [r for r in records if r.get("event") == "process_lost"]
  said = [re.search(r"redone: (\d+) step", line) for _, line in lines]
  out["redone"] = max([int(m.group(1)) for m in said if m], default=0)
  if kills and lost and "time" in lost[0]:
    out["known_s"] = lost[0]["time"] - kills[0][1]
    after = sorted(t for _, t in got.values() if t > lost[0]["time"])
    out["next_step_s"] = after[0] - kills[0][1] if after else None
    out["steady_step_s"] = step_s
  raised = [re.search(r"inside step \d+ (after its update )?\((\w+) phase", line)
            for _, line in lines]
  raised = [f"{m.group(2)} phase" + (" (after the update)" if m.group(1) else "")
            for m in raised if m]
  out["phase"] = raised[0] if raised else "between steps" if lost else None
  out["tail"] = [line for _, line in lines[-6:]] if not out["survived"] else []
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layouts", default="8x1,4x2,2x4")
  parser.add_argument("--trials", type=int, default=10)
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--window", default="10:20", help="steps between which kills land")
  parser.add_argument("--victims", choices=("nonzero", "any"), default="nonzero",
                      help="any: process 0 (JAX's coordination service) among the candidates")
  parser.add_argument("--pair", action="store_true", help="a second kill 1 s later")
  parser.add_argument("--set", action="append", default=[], help="a config override k=v")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--trial-timeout", type=float, default=900.0)
  parser.add_argument("--workdir", default="/tmp/ntp_jax_chaos")
  args = parser.parse_args()
  args.window = tuple(int(v) for v in args.window.split(":"))
  signal.signal(signal.SIGTERM, _stop_running)
  signal.signal(signal.SIGINT, _stop_running)
  rng = random.Random(args.seed)
  ref_dir = os.path.join(args.workdir, "reference")
  subprocess.run(["rm", "-rf", ref_dir], check=True)
  subprocess.run([sys.executable, *base_args(ref_dir, args.steps, args.set)], cwd=ROOT,
                 check=True, capture_output=True)
  reference = {s: v for s, (v, _) in losses_of(ref_dir)[0].items()}
  print(f"reference: one process, {args.steps} steps, final loss {reference[args.steps - 1]:.4f}")
  results = []
  for layout in args.layouts.split(","):
    for i in range(args.trials):
      r = trial(layout, i, args, reference, rng)
      results.append(r)
      fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
      print(f"{layout} trial {i}: {'survived' if r['survived'] else 'NOT survived'} "
            f"(status {r['status']}, killed {r['victims']}"
            f"{', survivors stopped ' + str(r['stopped']) if r['stopped'] else ''}), "
            f"redone {r['redone']}, "
            f"loss known after {fmt(r.get('known_s'))} s, next step after "
            f"{fmt(r.get('next_step_s'))} s (steady step {fmt(r.get('steady_step_s'))} s), "
            f"{r['phase']}", flush=True)
      for line in r["tail"]:
        print(f"    {line}")
  print("\n| layout | survived | loss known (s, median) | next productive step (s, median) |")
  print("|---|---|---|---|")
  for layout in args.layouts.split(","):
    rs = [r for r in results if r["layout"] == layout]
    known = [r["known_s"] for r in rs if r.get("known_s") is not None]
    nxt = [r["next_step_s"] for r in rs if r.get("next_step_s") is not None]
    med = lambda v: f"{np.median(v):.1f}" if v else "-"  # noqa: E731
    print(f"| {layout} | {sum(r['survived'] for r in rs)} of {len(rs)} | {med(known)} | "
          f"{med(nxt)} |")


if __name__ == "__main__":
  main()
