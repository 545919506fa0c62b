"""Failures across processes without a restart: live moves between hosts, a just-in-time
checkpoint when a process is lost, and survivors that go on (``distributed.recoverable``).

Each multi-process run is compared with the same run in this one process (8 CPU devices),
which equals the uninterrupted multi-process job (tests/system/test_multiprocess.py). Every process
started here runs under a timeout and is killed by id at the end.
"""

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
import pytest
from helpers import ROOT, job_output_tail, micro_config, process_env

from ntp_jax.launch import free_port
from ntp_jax.processes.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from ntp_jax.training.trainer import train

pytestmark = pytest.mark.multiprocess

STEPS = 12
BASE = {"mesh.dp": 2, "mesh.tp": 4, "train.log_every": 1, "train.steps": STEPS}
HEARTBEAT_S = 5


def _args(workdir, settings, program="train.py"):
  return [sys.executable, program, "--config", "configs/gpt_micro.py",
          f"--config.workdir={workdir}", "--config.train.plot=False",
          "--config.train.eval_every=0", "--config.data.max_corpus_bytes=300000",
          *[f"--config.{k}={v}" for k, v in settings.items()]]


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _losses(records):
  return {r["step"]: r["loss"] for r in records if "loss" in r and "event" not in r}


def _equal_losses(workdir, expected, steps=STEPS):
  """The run's records, after checking that its steps 0..steps-1 have ``expected``'s losses."""
  records = _records(workdir)
  losses = _losses(records)
  assert sorted(losses) == list(range(steps))
  np.testing.assert_allclose([losses[s] for s in range(steps)],
                             [expected[s] for s in range(steps)], rtol=1e-5)
  return records


def _reference(tmp_path, name, **settings):
  """The same run in this process: step -> loss, and its records."""
  workdir = tmp_path / name
  result = train(micro_config(workdir, **{**BASE, **settings}), log=lambda *_: None)
  records = _records(os.path.dirname(result.metrics_path))
  return _losses(records), records


@pytest.fixture(scope="module")
def base_losses(tmp_path_factory):
  """The plain run (``BASE``, no events) in this process: step -> loss. Two tests compare
  with it (a just-in-time checkpoint, the coordinator's loss); it is run once for both."""
  return _reference(tmp_path_factory.mktemp("base"), "one")[0]


def _launch(processes, workdir, settings, *, launcher=(), program="train.py", env=None,
            timeout=600):
  command = [sys.executable, "-m", "ntp_jax.launch", f"--processes={processes}", *launcher,
             "--", *_args(workdir, settings, program)]
  return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                        env=process_env(**(env or {})))


def test_failures_and_repairs_in_either_process_recover_live(tmp_path):
  """A device of replica 1 (process 1) fails and is repaired, then one of replica 0
  (process 0, which hosts the coordination service), in recoverable mode: nothing is lost,
  and the processes still end cleanly (the coordination service leaves recoverable tasks
  out of its shutdown barrier). Compiling ahead across processes is checked where a process
  is lost (below; ``bench/lost_process.py`` case C measures it for a failure and a repair)."""
  events = {"ntp.recovery": "live", "ntp.fail_at": "3@1:2,7@0:2",
            "ntp.repair_at": "5@1:2,9@0:2"}
  expected, _ = _reference(tmp_path, "one", **events)
  workdir = tmp_path / "two"
  done = _launch(2, workdir, {**BASE, **events, "checkpoint.every": 0, "ntp.precompile": "none",
                              "distributed.recoverable": True})
  assert done.returncode == 0, job_output_tail(done.stdout + done.stderr)
  records = _equal_losses(workdir, expected)
  degrees = {r["step"]: r["tp_degrees"] for r in records if "tp_degrees" in r}
  assert [degrees[s] for s in (2, 3, 4, 5, 6, 7, 8, 9, STEPS - 1)] == [
      [4, 4], [4, 3], [4, 3], [4, 4], [4, 4], [3, 4], [3, 4], [4, 4], [4, 4]]
  recovered = [r for r in records if r.get("event") == "recovered"]
  assert [r["path"] for r in recovered] == ["live"] * 4
  # Each damaged replica's own live slots hold part of its state; the rest crossed processes.
  assert recovered[0]["crossed_bytes"] > 0 and recovered[2]["crossed_bytes"] > 0
  assert "restoring" not in done.stdout and "resuming" not in done.stdout


def _run_until_killed(workdir, settings, die_after, processes=2):
  """The job under ``tests/programs/train_with_hooks.py``: process 1 SIGKILLs itself after
  step ``die_after``. Returns (process 0's status, seconds from the kill to its exit, its
  output)."""
  os.makedirs(workdir, exist_ok=True)
  port = free_port()
  children, logs = [], []
  for i in range(processes):
    env = process_env(**{ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: str(processes),
                  ENV_PROCESS_ID: str(i), "PYTHONUNBUFFERED": "1",
                  "NTP_JAX_DIE_AFTER": f"1:{die_after}"})
    log = open(os.path.join(workdir, f"process{i}.log"), "w")
    logs.append(log)
    children.append(subprocess.Popen(_args(workdir, settings, "tests/programs/train_with_hooks.py"),
                                     cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True))
  try:
    children[1].wait(timeout=400)
    killed = time.monotonic()
    status = children[0].wait(timeout=120)
    return status, time.monotonic() - killed, open(os.path.join(workdir, "process0.log")).read()
  finally:
    for child, log in zip(children, logs):
      if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
      log.close()


def test_a_lost_process_leaves_a_just_in_time_checkpoint_and_a_smaller_restart_resumes(
    tmp_path, base_losses):
  expected = base_losses
  workdir = tmp_path / "two"
  settings = {**BASE, "checkpoint.every": 1000,
              "distributed.heartbeat_timeout_s": HEARTBEAT_S}
  status, seconds, output = _run_until_killed(workdir, settings, die_after=6)
  assert status == 3, job_output_tail(output)
  assert "error: lost process 1 of 2" in output
  assert "wrote a just-in-time checkpoint of step 7" in output, job_output_tail(output, 2000)
  assert seconds < HEARTBEAT_S + 10, seconds
  checkpoints = workdir / "checkpoints"
  assert sorted(p for p in os.listdir(checkpoints) if p.isdigit()) == ["7"]

  # One process on the four devices left, the same global batch: it resumes at step 7.
  restart = subprocess.run(_args(workdir, {**settings, "mesh.dp": 1}), cwd=ROOT,
                           capture_output=True, text=True, timeout=400, env=process_env())
  assert restart.returncode == 0, restart.stderr[-3000:]
  assert "resuming from step 7" in restart.stdout
  # Steps 0-6 from the first session, 7-11 from the restart: only step 7 was in flight.
  _equal_losses(workdir, expected)


def _kill_when(launcher, lines, kills, rng, apart_s=None):
  """For each ``(process, step)`` of ``kills``: once step ``step``'s row is out, SIGKILL
  ``process`` (found by its ``NTP_JAX_PROCESS_ID`` among the launcher's children) after a
  delay drawn uniformly over a steady step's time, so that it lands wherever the run is:
  inside the next step (a phase of its collectives, a vote), or between steps.
  ``apart_s``: each kill after the first comes that many seconds after the one before
  instead (its step is not waited for)."""
  rows = {}
  for n, (process, step) in enumerate(kills):
    if apart_s is not None and n > 0:
      time.sleep(apart_s)
      os.kill(_child_of(launcher.pid, process), signal.SIGKILL)
      continue
    deadline = time.monotonic() + 400
    while step not in rows:
      assert time.monotonic() < deadline and launcher.poll() is None, "\n".join(lines[-30:])
      for at, line in list(lines):
        found = re.match(r"^\[\d\] step +(\d+)/\d+ \| loss", line)
        if found:
          rows.setdefault(int(found.group(1)), at)
      time.sleep(0.02)
    # A steady step's time: the shortest of the last gaps (the others may hold a recovery
    # or a wait for the compile ahead).
    gaps = [rows[s] - rows[s - 1] for s in range(step - 2, step + 1) if s - 1 in rows]
    time.sleep(rng.uniform(0.0, min(gaps) if gaps else 0.1))
    try:
      os.kill(_child_of(launcher.pid, process), signal.SIGKILL)
    except LookupError as err:  # it ended by itself: say how
      raise AssertionError("\n".join(line for _, line in lines[-40:])) from err


def _child_of(launcher: int, process: int) -> int:
  """The pid of the launcher's child that is process ``process`` of the job."""
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/stat") as f:
        if int(f.read().rsplit(")", 1)[1].split()[1]) != launcher:
          continue
      with open(f"/proc/{entry}/environ", "rb") as f:
        if f"{ENV_PROCESS_ID}={process}".encode() in f.read().split(b"\0"):
          return int(entry)
    except (OSError, ValueError, IndexError):
      continue
  raise LookupError(f"no process {process} under the launcher {launcher}")


def _four_killed(workdir, settings, kills, rng, env, apart_s=None) -> tuple[int, str]:
  """4 processes under ``launch --run-on`` (``train_with_hooks.py``), killed from outside as
  ``_kill_when`` says; returns the launcher's status and its output. The launcher's process
  group is killed if it outlives its 400 s."""
  command = [sys.executable, "-m", "ntp_jax.launch", "--processes=4", "--run-on", "--",
             *_args(workdir, settings, "tests/programs/train_with_hooks.py")]
  launcher = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True,
                              env=env)
  lines: list = []
  reader = threading.Thread(target=lambda: lines.extend(
      (time.monotonic(), line.rstrip()) for line in launcher.stdout), daemon=True)
  reader.start()
  try:
    _kill_when(launcher, lines, kills, rng, apart_s=apart_s)
    status = launcher.wait(timeout=400)
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
      launcher.wait()
  reader.join(timeout=10)
  return status, "\n".join(line for _, line in lines)


@pytest.mark.parametrize("seed", [0])
def test_processes_killed_from_outside_inside_steps_leave_their_replicas_at_a_lower_degree(
    tmp_path, seed):
  """One process per device (4 x 1, TP groups over two processes each), recoverable mode,
  compiling ahead: process 0 (the launcher hosts JAX's coordination service, so it is a
  worker like any other) is SIGKILLed from outside at a random moment after step 4's row,
  process 3 after step 8's: wherever each kill lands (inside a phase of a step's
  collectives, a vote, between steps), every survivor throws the step in flight away, and
  both replicas train on at TP degree 1. Nothing compiles on the way, and with a constant
  global batch the job trains exactly as the healthy run does; process 1 speaks for it once
  process 0 is gone."""
  steps = 16  # steps left after the second kill's row: a fast run must not end before it
  constant = {"ntp.rebalance": "constant", "mesh.tp": 2, "train.steps": steps}
  expected, _ = _reference(tmp_path, "one", **constant)
  workdir = tmp_path / "four"
  settings = {**BASE, **constant, "checkpoint.every": 0, "distributed.recoverable": True,
              "distributed.heartbeat_timeout_s": HEARTBEAT_S,
              "distributed.processes_per_domain": 2, "ntp.precompile": "next_failure"}
  status, output = _four_killed(workdir, settings, [(0, 4), (3, 8)], random.Random(seed),
                                env=process_env(NTP_JAX_WAIT_FOR_AHEAD="1"))
  assert status == 0, job_output_tail(output, 4000)
  said = [line for line in output.splitlines() if " exited with status " in line]
  assert said == [f"[launch] process {p} exited with status 137; the others run on"
                  for p in (0, 3)], job_output_tail(output)
  records = _equal_losses(workdir, expected, steps=steps)
  lost = [(r["step"], r["processes"]) for r in records if r.get("event") == "process_lost"]
  assert [p for _, p in lost] == [[0], [3]] and 5 <= lost[0][0] <= 7 and 9 <= lost[1][0] <= 11
  degrees = {r["step"]: r["tp_degrees"] for r in records if "tp_degrees" in r}
  assert degrees[lost[0][0] - 1] == [2, 2] and degrees[lost[0][0]] == [1, 2]
  assert degrees[lost[1][0]] == [1, 1] and degrees[steps - 1] == [1, 1]
  recovered = [r for r in records if r.get("event") == "recovered"]
  assert [r["path"] for r in recovered] == ["live", "live"]
  for row in recovered:  # the moves across processes, the new classes' steps and sync
    assert row["compiled_ahead"] and row["compile_s"] == 0.0, row
  assert [[p for p, _ in r["compile_s_by_process"]] for r in recovered] == [[1, 2, 3], [1, 2]]
  assert "[1] redone: 2 step(s)" in output
  assert {r["global_batch"] for r in records if "global_batch" in r} == {16}


@pytest.mark.parametrize("seed", [1])
def test_two_processes_of_different_replicas_killed_a_second_apart_are_survived_live(
    tmp_path, seed):
  """4 x 1 as above: process 0 (replica 0's slot 0) is SIGKILLed at a random moment after
  step 4's row, process 3 (replica 1's slot 1) one second later, before the first loss is
  known. No replica is left whole, but every shard unit has a live copy (process 1 holds
  replica 0's slot 1, process 2 replica 1's slot 0): the state moves live from the two
  partial replicas, both replicas train on at TP degree 1, and the losses are the healthy
  run's."""
  steps = 14
  constant = {"ntp.rebalance": "constant", "mesh.tp": 2, "train.steps": steps}
  expected, _ = _reference(tmp_path, "one", **constant)
  workdir = tmp_path / "four"
  settings = {**BASE, **constant, "checkpoint.every": 0, "distributed.recoverable": True,
              "distributed.heartbeat_timeout_s": HEARTBEAT_S,
              "distributed.processes_per_domain": 2}
  status, output = _four_killed(workdir, settings, [(0, 4), (3, 4)], random.Random(seed),
                                env=process_env(), apart_s=1.0)
  assert status == 0, job_output_tail(output, 4000)
  records = _equal_losses(workdir, expected, steps=steps)
  lost = [p for r in records if r.get("event") == "process_lost" for p in r["processes"]]
  assert sorted(lost) == [0, 3], job_output_tail(output)
  degrees = {r["step"]: r["tp_degrees"] for r in records if "tp_degrees" in r}
  assert degrees[steps - 1] == [1, 1]
  # The last recovery moved the state live (one before it may have been interrupted by the
  # second loss and started again from the old state).
  paths = [r.get("path") for r in records if r.get("event") == "recovered"]
  assert paths[-1] == "live" and set(paths) <= {"live", "interrupted"}, job_output_tail(output)
  assert "restor" not in output, job_output_tail(output)


def test_a_process_lost_inside_a_checkpoint_save_is_survived_and_the_save_made_again(
    tmp_path):
  """3 processes of 2 devices, one replica each (dp=3 tp=2), recoverable, a checkpoint every
  4 steps: process 2 dies inside the save of step 4, as the state is read off the devices.
  The survivors' save collectives raise; they agree on the loss, move the state onto the
  two replicas left and save step 4 again there; no step is redone, and the losses are the
  healthy one-process run's (constant global batch)."""
  steps = 10
  constant = {"ntp.rebalance": "constant", "mesh.dp": 3, "mesh.tp": 2,
              "train.batch_size": 18, "train.steps": steps}
  expected, _ = _reference(tmp_path, "one", **constant, **{"checkpoint.every": 0})
  workdir = tmp_path / "three"
  settings = {**BASE, **constant, "checkpoint.every": 4, "distributed.recoverable": True,
              "distributed.heartbeat_timeout_s": HEARTBEAT_S}
  result = _launch(3, workdir, settings, launcher=["--run-on"],
                   program="tests/programs/train_with_hooks.py",
                   env={"NTP_JAX_DIE_IN_SAVE": "2:4"}, timeout=400)
  output = result.stdout + result.stderr
  assert result.returncode == 0, job_output_tail(output, 4000)
  assert "lost process 2 of 3 while saving the checkpoint of step 4" in output, \
      job_output_tail(output)
  records = _equal_losses(workdir, expected, steps=steps)
  lost = [(r["step"], r["processes"]) for r in records if r.get("event") == "process_lost"]
  assert lost == [(4, [2])], lost
  degrees = {r["step"]: r["tp_degrees"] for r in records if "tp_degrees" in r}
  assert degrees[3] == [2, 2, 2] and degrees[4] == [2, 2]
  assert "redone" not in output, job_output_tail(output)
  checkpoints = os.listdir(workdir / "checkpoints")
  assert {"8", "10"} <= set(checkpoints), checkpoints  # saves go on over the survivors


def test_the_coordinators_loss_ends_the_job_and_a_rerun_resumes_from_the_last_checkpoint(
    tmp_path, base_losses):
  """Process 0 hosts JAX's coordination service: when it dies, JAX ends the other processes
  (a check failure, SIGABRT) at once; the launcher says so in one line, the checkpoints
  already written are whole, and running the job again resumes exactly."""
  expected = base_losses
  workdir = tmp_path / "two"
  settings = {**BASE, "checkpoint.every": 3, "distributed.heartbeat_timeout_s": HEARTBEAT_S}
  start = time.monotonic()
  done = _launch(2, workdir, settings, program="tests/programs/train_with_hooks.py",
                 env={"NTP_JAX_DIE_AFTER": "0:6"}, timeout=300)
  assert done.returncode == 137, job_output_tail(done.stdout + done.stderr)
  assert "[launch] process 0 hosted JAX's coordination service: losing it ended processes " \
         "[1] (status 134" in done.stderr, done.stderr[-2000:]
  assert time.monotonic() - start < 240
  checkpoints = sorted(p for p in os.listdir(workdir / "checkpoints") if p.isdigit())
  # Step 6's save runs in the background: it was whole before the loss, or it is not listed.
  assert checkpoints[-1] in ("3", "6"), checkpoints
  again = _launch(2, workdir, settings, timeout=300)
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
  assert f"resuming from step {checkpoints[-1]}" in again.stdout
  _equal_losses(workdir, expected)


def test_sharded_optimizer_across_processes_with_one_holding_no_core_device(tmp_path):
  """zero2 over 4 processes of 2 devices (TP groups over two processes), replica 1 at TP
  degree 2 from the start: process 1 holds only replica 0's slots 2 and 3, past t_min, so
  it holds no piece of the optimizer state and gets the metrics through its class. The
  losses equal the same run in one process."""
  settings = {"ntp.failed": "1:1,1:2", "train.steps": 4, "train.optimizer_sharding": "zero2",
              "train.microbatches": 2}
  expected, _ = _reference(tmp_path, "one", **settings)
  workdir = tmp_path / "four"
  done = _launch(4, workdir, {**BASE, **settings, "checkpoint.every": 0,
                              "distributed.processes_per_domain": 2}, timeout=300)
  assert done.returncode == 0, job_output_tail(done.stdout + done.stderr)
  _equal_losses(workdir, expected, steps=4)


def test_a_lost_process_holding_optimizer_pieces_takes_the_restart_path(tmp_path):
  """zero1 with one copy, recoverable: process 1 (replica 1) is lost after step 6. Its
  pieces are gone with it, so the survivor says why in one line and restores checkpoint 4
  onto replica 0 alone: the losses equal one process's run whose replica 1 fails at step 7
  with ntp.recovery=restart."""
  settings = {"train.optimizer_sharding": "zero1", "checkpoint.every": 4}
  expected, _ = _reference(tmp_path, "one", **settings, **{
      "ntp.recovery": "restart", "ntp.fail_at": ",".join(f"7@1:{s}" for s in range(4))})
  workdir = tmp_path / "two"
  done = _launch(2, workdir, {**BASE, **settings, "distributed.recoverable": True,
                              "distributed.heartbeat_timeout_s": HEARTBEAT_S},
                 launcher=["--run-on"], program="tests/programs/train_with_hooks.py",
                 env={"NTP_JAX_DIE_AFTER": "1:6"}, timeout=300)
  assert done.returncode == 0, job_output_tail(done.stdout + done.stderr)
  assert ("live recovery impossible (optimizer state piece 1 (of every peer group) was held "
          "only by replicas of lost processes (train.optimizer_copies=1)); restoring the last "
          "checkpoint instead") in done.stdout, done.stdout[-3000:]
  records = _equal_losses(workdir, expected)
  assert [r["path"] for r in records if r.get("event") == "recovered"] == ["restart"]


def test_a_process_lost_inside_the_sharded_norm_leaves_its_replica_at_a_lower_degree(tmp_path):
  """zero1 with two copies, one process per device (4 x 1, dp=2 tp=2), recoverable: process 3
  dies as step 4 enters the norm's all-reduce (over its replica's core devices). Process 2,
  the one survivor in that all-reduce, is handed its failure at the program's dispatch
  (jaxlib raises it as a ValueError there), votes it, and goes on with the others: the step
  is thrown away, replica 1 trains on at TP degree 1, and with a constant global batch the
  losses are the healthy one-process run's."""
  steps = 8
  settings = {"mesh.tp": 2, "train.steps": steps, "ntp.rebalance": "constant",
              "train.optimizer_sharding": "zero1", "train.optimizer_copies": 2}
  expected, _ = _reference(tmp_path, "one", **settings)
  workdir = tmp_path / "four"
  done = _launch(4, workdir, {**BASE, **settings, "checkpoint.every": 0,
                              "distributed.recoverable": True,
                              "distributed.heartbeat_timeout_s": HEARTBEAT_S,
                              "distributed.processes_per_domain": 2, "ntp.precompile": "none"},
                 launcher=["--run-on"], program="tests/programs/train_with_hooks.py",
                 env={"NTP_JAX_DIE_IN_PHASE": "3:4:norm"}, timeout=300)
  output = done.stdout + done.stderr
  assert done.returncode == 0, job_output_tail(output, 4000)
  assert "lost process 3 of 4 inside step 4 (norm phase" in output, job_output_tail(output)
  assert [line for line in output.splitlines() if " exited with status " in line] == [
      "[launch] process 3 exited with status 137; the others run on"], job_output_tail(output)
  records = _equal_losses(workdir, expected, steps=steps)
  degrees = {r["step"]: r["tp_degrees"] for r in records if "tp_degrees" in r}
  assert degrees[3] == [2, 2] and degrees[4] == [2, 1]


def test_a_lost_process_holding_optimizer_pieces_rebuilds_them_live_from_copies(tmp_path):
  """zero1 with two copies of two pieces, 4 processes of one replica each (dp=4 tp=2),
  recoverable. At step 3 replica 0's slot 0 fails in live process 0: its piece's only
  live copy is replica 2's, in process 2, and comes from there. Process 1 (replica 1,
  piece 1) dies inside step 4 after its update committed, as the parameters are unpacked:
  the step stands, and the three survivors rebuild the parameters and the optimizer state
  from the pieces among themselves (piece 1 from replica 3) and move them onto their plan
  live. The losses equal one process's run with the same failures. (Compiled ahead, the
  lost process's recovery compiles nothing on the way: ``bench/lost_process.py`` case E;
  here it would add a minute.)"""
  settings = {"mesh.dp": 4, "mesh.tp": 2, "train.optimizer_sharding": "zero1",
              "train.optimizer_copies": 2, "ntp.recovery": "live"}
  expected, _ = _reference(tmp_path, "one", **settings, **{
      "ntp.fail_at": "3@0:0,5@1:0,5@1:1"})
  workdir = tmp_path / "four"
  done = _launch(4, workdir, {**BASE, **settings, "checkpoint.every": 0, "ntp.fail_at": "3@0:0",
                              "distributed.recoverable": True,
                              "distributed.heartbeat_timeout_s": HEARTBEAT_S,
                              "ntp.precompile": "none"},
                 launcher=["--run-on"], program="tests/programs/train_with_hooks.py",
                 env={"NTP_JAX_DIE_IN_PHASE": "1:4:unpack"}, timeout=300)
  assert done.returncode == 0, job_output_tail(done.stdout + done.stderr)
  assert "lost process 1 of 4 inside step 4 after its update (unpack phase" in done.stdout, \
      done.stdout[-3000:]
  assert "live recovery impossible" not in done.stdout, done.stdout[-3000:]
  records = _equal_losses(workdir, expected)
  recovered = [r for r in records if r.get("event") == "recovered"]
  assert [r["path"] for r in recovered] == ["live", "live"]  # before: the restart path
  assert [(r["step"], r["processes"]) for r in records
          if r.get("event") == "process_lost"] == [(5, [1])]
  assert "redone" not in done.stdout, done.stdout[-3000:]
