"""A lost GPU is a lost process: the damaged replica trains on at a reduced TP degree.

  python bench/lost_process.py [--steps 30] [--after 15] [--heartbeat 5] [--cases A,B,C,D,E,F]

gpt_tiny, dp=2 tp=4, on CPU devices, one job under ``python -m ntp_jax.launch``:

- **A**: 4 processes x 2 devices, each TP group over two processes
  (``distributed.processes_per_domain=2``), recoverable mode, constant global
  batch, compiling ahead; process 3 (replica 1's slots 2 and 3) is SIGKILLed after
  step ``after`` (``tests/programs/train_with_hooks.py``). Compared with one
  process running ``ntp.fail_at={after+1}@1:2,{after+1}@1:3``.
- **B**: the same with 8 processes x 1 device (one process per GPU); process 6
  (replica 1's slot 2) is killed. Compared with ``ntp.fail_at={after+1}@1:2``.
- **C**: 2 processes x 4 devices, compiling ahead, a live failure and repair of
  slot 1:2 at steps 20 and 30 of 40 (``ntp.fail_at`` / ``ntp.repair_at``).
- **D**: process 0 (the coordination service's host) killed after step ``after``
  of 2 processes x 4 devices, checkpoint every 5 steps, with and without
  recoverable mode; then the same job again, which resumes.
- **E**: the optimizer state sharded (``train.optimizer_sharding=zero1``, two copies of
  two pieces), 4 processes x 2 devices at dp=4 tp=2 (one replica each), recoverable,
  compiling ahead; process 1 (replica 1, piece 1) is killed after step ``after``: the
  survivors read the state back among themselves (piece 1 from replica 3) and move it
  live. Compared with ``ntp.fail_at={after+1}@1:0,{after+1}@1:1``.
- **F**: B with the optimizer state sharded (zero1, two copies of one piece): process 7
  (replica 1's slot 3) is killed, replica 1 trains on at degree 3, and process 3 (replica
  0's slot 3, past the new t_min) holds no core device, so it gets each step's metrics
  through its class (``parallel.metrics_handoff``), a program compiled ahead with the rest.
  Compared with ``ntp.fail_at={after+1}@1:3``.

Each case prints what the survivors did: exit status, TP degrees before and
after, the global batch, steps redone, each ``recovered`` row's compile
seconds, and the largest relative loss difference from the reference.
Compiling ahead, every step waits for the background compile to finish (as a
long run's failures come long after it has). Run it alone: the processes share
the machine's cores.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recovery_processes import AHEAD, ROOT, WAIT, _args, _env, _events, _launch, _rows  # noqa: E402


def _losses(rows):
  return {r["step"]: r["loss"] for r in rows if "loss" in r and "event" not in r}


def _reference(workdir, settings):
  """The same job in one process on 8 CPU devices: step -> loss."""
  env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
  done = subprocess.run([sys.executable, *_args(workdir, settings)], cwd=ROOT,
                        capture_output=True, text=True, timeout=900, env=env)
  if done.returncode != 0:
    raise SystemExit(f"reference failed: {done.stderr[-2000:]}")
  return _losses(_rows(workdir))


def _report(name, done, rows, reference, steps):
  losses = _losses(rows)
  degrees = [r["tp_degrees"] for r in rows if "tp_degrees" in r and "event" not in r]
  batches = sorted({r["global_batch"] for r in rows if "global_batch" in r})
  # The most over the plan's live processes (each one's: compile_s_by_process).
  compile_s = [round(r["compile_s"], 2) for r in _events(rows, "recovered")]
  processes = [len(r.get("compile_s_by_process", [])) for r in _events(rows, "recovered")]
  ahead = [r["compiled_ahead"] for r in _events(rows, "recovered")]
  paths = [r["path"] for r in _events(rows, "recovered")]
  redone = next((line.split("redone: ")[1] for line in done.stdout.splitlines()
                 if "redone: " in line), "0 step(s)")
  common = [s for s in range(steps) if s in losses and s in reference]
  diff = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in common)
  print(f"{name}: exit {done.returncode}, steps {len(losses)}/{steps}, TP degrees "
        f"{degrees[0]} -> {degrees[-1]}, global batch {batches}, redone {redone}, "
        f"recovered {paths} compile_s {compile_s} (the most over {processes} processes; "
        f"compiled ahead {ahead}), max relative loss "
        f"difference {diff:.1e} over {len(common)} steps")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--after", type=int, default=15)
  parser.add_argument("--heartbeat", type=float, default=5.0)
  parser.add_argument("--cases", default="A,B,C,D,E,F")
  args = parser.parse_args()
  cases = set(args.cases.split(","))
  steps, after = args.steps, args.after
  base = {"mesh.dp": 2, "mesh.tp": 4, "train.steps": steps, "train.log_every": 1,
          "distributed.heartbeat_timeout_s": args.heartbeat}
  lose = {**base, "ntp.rebalance": "constant", "distributed.recoverable": True,
          "distributed.processes_per_domain": 2, "checkpoint.every": 0, **AHEAD}
  print(f"`python bench/lost_process.py --steps {steps} --after {after} --heartbeat "
        f"{args.heartbeat:g} --cases {args.cases}` (cpu, gpt_tiny, dp=2 tp=4)\n")
  with tempfile.TemporaryDirectory() as tmp:
    sharded = {"train.optimizer_sharding": "zero1", "train.optimizer_copies": 2}
    for case, processes, victim, slots, more in (("A", 4, 3, "1:2,1:3", {}),
                                                 ("B", 8, 6, "1:2", {}),
                                                 ("F", 8, 7, "1:3", sharded)):
      if case not in cases:
        continue
      fails = ",".join(f"{after + 1}@{s}" for s in slots.split(","))
      reference = _reference(os.path.join(tmp, f"{case}ref"), {
          **base, **more, "ntp.rebalance": "constant", "ntp.fail_at": fails})
      work = os.path.join(tmp, case)
      settings = {**lose, **more, "distributed.processes_per_domain": processes // 2}
      done = _launch(work, settings, program="tests/programs/train_with_hooks.py",
                     launcher=["--run-on"], processes=processes,
                     env={"NTP_JAX_DIE_AFTER": f"{victim}:{after}", **WAIT})
      _report(f"{case}: {processes} x {8 // processes}{', zero1 with 2 copies' if more else ''}, "
              f"process {victim} killed after step {after}", done, _rows(work), reference, steps)

    if "C" in cases:
      events = {"ntp.recovery": "live", "ntp.fail_at": "20@1:2", "ntp.repair_at": "30@1:2",
                "train.steps": 40, "checkpoint.every": 0}
      reference = _reference(os.path.join(tmp, "Cref"), {**base, **events})
      work = os.path.join(tmp, "C")
      done = _launch(work, {**base, **events, **AHEAD},
                     program="tests/programs/train_with_hooks.py", env=WAIT)
      _report("C: 2 x 4, live failure and repair of 1:2 at 20 and 30", done, _rows(work),
              reference, 40)

    if "E" in cases:
      zero = {**base, "mesh.dp": 4, "mesh.tp": 2, "train.optimizer_sharding": "zero1",
              "train.optimizer_copies": 2, "ntp.recovery": "live"}
      reference = _reference(os.path.join(tmp, "Eref"), {
          **zero, "ntp.fail_at": f"{after + 1}@1:0,{after + 1}@1:1"})
      work = os.path.join(tmp, "E")
      done = _launch(work, {**zero, "distributed.recoverable": True, "checkpoint.every": 0,
                            **AHEAD}, program="tests/programs/train_with_hooks.py",
                     launcher=["--run-on"], processes=4,
                     env={"NTP_JAX_DIE_AFTER": f"1:{after}", **WAIT})
      _report(f"E: 4 x 2, zero1 with 2 copies, process 1 killed after step {after}", done,
              _rows(work), reference, steps)

    if "D" in cases:
      reference = _reference(os.path.join(tmp, "Dref"), base)
      for recoverable in (False, True):
        work = os.path.join(tmp, f"D{int(recoverable)}")
        settings = {**base, "checkpoint.every": 5, "distributed.recoverable": recoverable}
        done = _launch(work, settings, program="tests/programs/train_with_hooks.py",
                       env={"NTP_JAX_DIE_AFTER": f"0:{after}"})
        ended = time.time()
        rows = _rows(work)
        # The kill comes once process 1 waits at step after+1: time from process 0's last row.
        last = max(r["time"] for r in rows if "time" in r)
        line = [ln for ln in done.stderr.splitlines() if "coordination service" in ln]
        saved = sorted(int(p) for p in os.listdir(os.path.join(work, "checkpoints"))
                       if p.isdigit())
        again = _launch(work, settings)
        resumed = [ln for ln in again.stdout.splitlines() if "resuming from step" in ln]
        _report(f"D: 2 x 4, process 0 killed after step {after}, recoverable={recoverable}; "
                f"job exit {done.returncode} {ended - last:.1f} s after process 0's last "
                f"row, launcher: "
                f"{line[0][:90] if line else 'no line'}...; checkpoints {saved}; rerun: "
                f"{resumed[0].strip() if resumed else 'did not resume'}", again, _rows(work),
                reference, steps)


if __name__ == "__main__":
  main()
