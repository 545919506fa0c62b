"""What a failure costs across processes: seconds from the failure to the next productive step.

  python bench/recovery_processes.py [--steps 30] [--at 24] [--heartbeat 5]

gpt_tiny as 2 processes x 4 CPU devices (``python -m ntp_jax.launch``), dp=2 tp=4:

- *live*: slot 2 of replica 1 (process 1's) fails before step ``at``; the state
  moves from DP peers across processes (``ntp.recovery=live``). From the end of
  step ``at - 1`` to the end of step ``at`` on the new plan.
- *just-in-time*: process 1 is SIGKILLed after step ``at - 1``
  (``tests/programs/train_with_hooks.py``); process 0 finds it lost (heartbeat),
  writes step ``at`` and stops; a one-process restart on the four devices left
  (``mesh.dp=1``) resumes there. From the end of step ``at - 1`` to the end of
  step ``at`` in the restart.
- *periodic*: the same loss with ``distributed.jit_checkpoint_s=0`` and a
  checkpoint every 10 steps: the restart resumes from the last one and redoes
  the steps since.
- *recoverable*: the same loss with ``distributed.recoverable=True`` and
  ``ntp.rebalance=constant``: process 0 goes on alone. From the end of step
  ``at - 1`` to the end of step ``at`` (the step in flight, redone).

*live* and *recoverable* run twice: as they are, and compiled ahead
(``ntp.precompile=next_failure``, each step waiting for the background compile
to finish, as a long run's failures come long after it has).

Then the live move against its floors: the state's own move (``transfer_s`` of the
``recovered`` row, compiled ahead; ``move_s`` also holds building the new plan's
class programs) against one collective carrying the same bytes between the two
processes over the same live devices (``bench/collective_floor.py``), both its first
run (the first collective over that set of devices, as the move's is) and its fastest
after; and the live path against the restart from the just-in-time checkpoint.

Times are read from the ``time`` of the step rows in ``metrics.jsonl``; the
restarts start as soon as the survivor has exited (a scheduler's own delay is
not counted). Every run has a fresh work folder (a cold compilation cache).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Compiled ahead: the plans one event away compile in the background, and the run lets
# them finish before each step (as a long run's failures come long after they have).
AHEAD = {"ntp.precompile": "next_failure"}
WAIT = {"NTP_JAX_WAIT_FOR_AHEAD": "1"}


def _env(**extra):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.update(extra)
  return env


def _args(workdir, settings, program="train.py"):
  return [program, "--config", "configs/gpt_tiny.py", f"--config.workdir={workdir}",
          "--config.train.plot=False", "--config.train.eval_every=0",
          "--config.data.max_corpus_bytes=300000",
          *[f"--config.{k}={v}" for k, v in settings.items()]]


def _launch(workdir, settings, *, program="train.py", launcher=(), env=None, processes=2):
  command = [sys.executable, "-m", "ntp_jax.launch", f"--processes={processes}", *launcher,
             "--", sys.executable, *_args(workdir, settings, program)]
  return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900,
                        env=_env(**(env or {})))


def _restart(workdir, settings):
  done = subprocess.run([sys.executable, *_args(workdir, {**settings, "mesh.dp": 1})],
                        cwd=ROOT, capture_output=True, text=True, timeout=900, env=_env())
  if done.returncode != 0:
    raise SystemExit(f"restart failed: {done.stderr[-2000:]}")
  return done


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _step_times(rows):
  """step -> wall time of its last row (a redone step: the later one)."""
  return {r["step"]: r["time"] for r in rows if "loss" in r and "event" not in r}


def _events(rows, name):
  return [r for r in rows if r.get("event") == name]


def collective_seconds(nbytes: int) -> tuple[float, float]:
  """One collective carrying ``nbytes`` between the processes over the live devices of the
  live case (``collective_floor.py``), compiled: its first run (gloo connecting that set of
  devices, as the move's first run does) and the fastest of ten after it."""
  command = [sys.executable, "-m", "ntp_jax.launch", "--processes=2", "--devices-per-process=4",
             "--", sys.executable, os.path.join("bench", "collective_floor.py"), str(nbytes)]
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                        env=_env())
  line = next((x for x in done.stdout.splitlines() if "collective_s=" in x), None)
  if done.returncode != 0 or line is None:
    raise SystemExit(f"collective floor failed: {done.stderr[-2000:]}")
  figures = dict(item.split("=") for item in line.split("] ")[-1].split())
  return float(figures["first_s"]), float(figures["collective_s"])


def _live_row(work, settings, at, ahead, env, name, launcher=()):
  """The row of a run that recovers without a restart, compiled ahead or not."""
  done = _launch(work, {**settings, **(AHEAD if ahead else {})},
                 program="tests/programs/train_with_hooks.py", launcher=launcher,
                 env={**env, **(WAIT if ahead else {})})
  if done.returncode != 0:
    raise SystemExit(done.stdout[-3000:])
  rows = _rows(work)
  times, recovered = _step_times(rows), _events(rows, "recovered")[0]
  crossed = recovered.get("crossed_bytes")
  return (name + (", compiled ahead" if ahead else ""), times[at] - times[at - 1], 0,
          f"move {recovered['move_s']:.2f} s (the state's own {recovered['transfer_s']:.3f} s), "
          f"compile {recovered['compile_s']:.2f} s"
          + (f", {crossed / 1e6:.2f} MB between processes" if crossed else ""),
          recovered['transfer_s'], crossed)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--at", type=int, default=25)
  parser.add_argument("--heartbeat", type=float, default=5.0)
  args = parser.parse_args()
  at, base = args.at, {"mesh.dp": 2, "mesh.tp": 4, "train.steps": args.steps,
                       "train.log_every": 1,
                       "distributed.heartbeat_timeout_s": args.heartbeat}
  die = {"NTP_JAX_DIE_AFTER": f"1:{at - 1}"}
  results = []
  with tempfile.TemporaryDirectory() as tmp:
    live = {"ntp.recovery": "live", "ntp.fail_at": f"{at}@1:2", "checkpoint.every": 0}
    for ahead in (False, True):
      results.append(_live_row(
          os.path.join(tmp, f"live{int(ahead)}"), {**base, **live}, at, ahead, {},
          "live across processes (process 1's slot 2 fails, its process lives)"))

    for name, extra in (("just-in-time checkpoint", {"checkpoint.every": 1000}),
                        ("last periodic checkpoint (every 10 steps)",
                         {"checkpoint.every": 10, "distributed.jit_checkpoint_s": 0})):
      work = os.path.join(tmp, name.split()[0])
      settings = {**base, **extra}
      # Without a just-in-time checkpoint no process publishes its arrival: die at once.
      at_once = {"NTP_JAX_DIE_AT_ONCE": "1"} if "distributed.jit_checkpoint_s" in extra else {}
      _launch(work, settings, program="tests/programs/train_with_hooks.py",
              env={**die, **at_once})
      lost_at = _step_times(_rows(work))[at - 1]
      saved = sorted(int(p) for p in os.listdir(os.path.join(work, "checkpoints")) if p.isdigit())
      _restart(work, settings)
      times = _step_times(_rows(work))
      jit = _events(_rows(work), "just_in_time")
      note = (f"survivor wrote step {jit[0]['step']} in {jit[0]['seconds']:.2f} s" if jit else
              f"restart from step {saved[-1]}")
      results.append((f"process 1 lost, restart from the {name}", times[at] - lost_at,
                      at - saved[-1], note, None, None))

    goes_on = {"checkpoint.every": 1000, "distributed.recoverable": True,
               "ntp.rebalance": "constant"}
    for ahead in (False, True):
      results.append(_live_row(
          os.path.join(tmp, f"recoverable{int(ahead)}"), {**base, **goes_on}, at, ahead, die,
          "process 1 lost, survivors go on (distributed.recoverable)", launcher=["--run-on"]))

  print(f"`python bench/recovery_processes.py --steps {args.steps} --at {args.at} "
        f"--heartbeat {args.heartbeat:g}` (cpu, 2 processes x 4 devices, gpt_tiny, dp=2 tp=4, "
        f"heartbeat {args.heartbeat:g} s)\n")
  print("| failure | seconds to the next productive step | steps redone before it | notes |")
  print("|---|---:|---:|---|")
  for name, seconds, redone, note, _, _ in results:
    print(f"| {name} | {seconds:.1f} | {redone} | {note} |")
  # The live move across processes against its floors, compiled ahead.
  _, live_s, _, _, move_s, crossed = results[1]
  jit_s = results[2][1]
  first, warm = collective_seconds(crossed)
  print("\n| figure | value |\n|---|---|")
  for what, floor in (("its first run over these live devices", first),
                      ("the fastest of 10 after it", warm)):
    print(f"| live move across processes, compiled ahead (the state's own, ``transfer_s``) / "
          f"one collective of the same {crossed / 1e6:.2f} MB between the processes over the "
          f"same live devices, {what} | {move_s:.4f} s / {floor:.4f} s = {move_s / floor:.1f} |")
  print(f"| live across processes, compiled ahead / restart from the just-in-time checkpoint | "
        f"{live_s:.1f} s / {jit_s:.1f} s = {live_s / jit_s:.2f} |")


if __name__ == "__main__":
  main()
