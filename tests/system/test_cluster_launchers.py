"""docs/multihost.md's SLURM and Open MPI examples, run as written on this machine: JAX finds
the job in the launcher's environment (no ``NTP_JAX_*`` variables), gpt_tiny as 2 replicas of
TP 4 in 2 processes of 4 CPU devices.

Each test: a run stopped from outside (``scancel``; SIGTERM to ``mpirun``) stops every process
at one step with one checkpoint, before the launcher's SIGKILL; a rerun resumes there; under
``mpirun`` the losses of both equal those of one uninterrupted run under ``python -m
ntp_jax.launch``. Every
run follows one learning-rate curve (``train.schedule_steps``), so a run of any length is a
prefix of a longer one. Skipped, with one line, where SLURM or Open MPI is not installed
(``.ci/run`` installs them). Every process started here is stopped by its id at the end.
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import local_slurm
import numpy as np
import psutil
import pytest
from helpers import ROOT, process_env

from ntp_jax.launch import free_port
from ntp_jax.training.metrics import read_metrics, read_records

DOCS = os.path.join(ROOT, "docs", "multihost.md")
SCHEDULE = 1000  # the learning-rate curve's length; a run stopped from outside asks for it all
COMMON = [f"--config.train.schedule_steps={SCHEDULE}", f"--config.checkpoint.every={SCHEDULE}",
          "--config.train.plot=False", "--config.train.eval_every=0",
          "--config.data.max_corpus_bytes=300000", "--config.train.log_every=1"]
RESUMED_STEPS = 3  # steps the rerun trains after the stop
# mpirun sends SIGTERM this long after its own, and SIGKILL as long again (the docs' command):
# a stop took up to 13 s from the SIGTERM to the end (two steps, the checkpoint, the exit)
# on 2 cores shared with other jobs.
MPI_SIGKILL_TIMEOUT_S = 20


def docs_example(containing: str) -> str:
  """The one fenced code block of docs/multihost.md that contains ``containing``."""
  blocks = re.findall(r"```bash\n(.*?)```", open(DOCS).read(), flags=re.S)
  found = [b for b in blocks if containing in b]
  assert len(found) == 1, f"{len(found)} blocks of {DOCS} contain {containing!r}"
  return found[0]


def job_env(**extra):
  """The tests' environment with this interpreter's ``python`` first on PATH."""
  path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
  return process_env(PATH=path, PYTHONUNBUFFERED="1", **extra)


def wait_for_row(workdir, wanted, alive, timeout_s: float = 90, context=str) -> None:
  """Until a row of ``metrics.jsonl`` is ``wanted`` (a predicate); fails when ``alive()``
  turns False first, with ``context()`` (the launcher's logs) in the message."""
  metrics = os.path.join(workdir, "metrics.jsonl")
  deadline = time.monotonic() + timeout_s
  while not (os.path.exists(metrics) and any(wanted(r) for r in read_records(metrics))):
    assert alive(), f"the job ended before its first steps\n{context()}"
    assert time.monotonic() < deadline, f"no such row of {metrics} in {timeout_s:g} s\n{context()}"
    time.sleep(0.3)


def the_one_stop(workdir) -> int:
  """The step the stop from outside ended at: its row says SIGTERM and names the only
  checkpoint."""
  stops = [r for r in read_records(os.path.join(workdir, "metrics.jsonl"))
           if r.get("event") == "stop"]
  assert len(stops) == 1 and stops[0]["signal"] == "SIGTERM", stops
  step = stops[0]["step"]
  checkpoints = sorted(p for p in os.listdir(os.path.join(workdir, "checkpoints")) if p.isdigit())
  assert checkpoints == [str(step)], checkpoints
  assert stops[0]["checkpoint"].endswith(os.path.join("checkpoints", str(step)))
  return step


def assert_launcher_losses(workdir, tmp_path, steps: int) -> None:
  """The losses of ``workdir`` (a stopped run and its rerun) equal those of one run of
  ``steps`` steps under ``python -m ntp_jax.launch --processes 2``."""
  reference = tmp_path / "launcher"
  command = [sys.executable, "-m", "ntp_jax.launch", "--processes=2", "--", sys.executable,
             "train.py", "--config", "configs/gpt_tiny.py", "--config.mesh.dp=2",
             "--config.mesh.tp=4", f"--config.workdir={reference}", f"--config.train.steps={steps}",
             *COMMON]
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                        env=process_env())
  assert done.returncode == 0, done.stdout[-3000:]
  expected = [r["loss"] for r in read_metrics(os.path.join(reference, "metrics.jsonl"))]
  got = [r["loss"] for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))]
  assert len(got) == len(expected) == steps
  np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.fixture
def slurm(tmp_path):
  if why := local_slurm.missing():
    pytest.skip(why)
  cluster = local_slurm.LocalSlurm(tmp_path / "slurm", free_port, job_env())
  try:
    yield cluster.start()
  finally:
    cluster.stop()


@pytest.mark.multiprocess
def test_the_docs_sbatch_script_stops_on_scancel_with_one_checkpoint_and_resumes(
    tmp_path, slurm):
  script = tmp_path / "tiny.sbatch"
  script.write_text(docs_example("#SBATCH --ntasks=2"))
  workdir = tmp_path / "run"

  def submit(steps):
    return slurm.submit(f"--chdir={ROOT}", f"--output={tmp_path}/slurm-%j.out", str(script),
                        f"--config.workdir={workdir}", f"--config.train.steps={steps}", *COMMON)

  job = submit(SCHEDULE)
  # Once step 1 is done, every task takes signals (the trainer's stop handler).
  wait_for_row(workdir, lambda r: r.get("step", -1) >= 1 and "loss" in r,
               alive=lambda: slurm.running(job), context=slurm.logs)
  slurm.run("scancel", job)  # SIGTERM to every task, SIGKILL after KillWait
  ended_in = slurm.wait(job, local_slurm.KILL_WAIT_S)
  output = (tmp_path / f"slurm-{job}.out").read_text()
  assert ended_in < local_slurm.KILL_WAIT_S - 10, output[-3000:]  # no task waited for SIGKILL
  assert "1: process 1 of 2: 4 local devices, replicas [1]" in output, output[-3000:]
  stopped = the_one_stop(workdir)
  assert f"0: interrupted at step {stopped} (SIGTERM)" in output, output[-3000:]

  rerun = submit(stopped + RESUMED_STEPS)
  slurm.wait(rerun, 120)
  output = (tmp_path / f"slurm-{rerun}.out").read_text()
  assert f"0: resuming from step {stopped}" in output, output[-3000:]
  assert "srun: error" not in output, output[-3000:]  # srun names a task that failed
  # Every step's loss, once: that a stopped and resumed run equals the uninterrupted one
  # is the mpirun test's check (the same trainer; SLURM only starts the processes).
  steps = [r["step"] for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))]
  assert steps == list(range(stopped + RESUMED_STEPS)), steps


def _mpirun(command, log):
  env = job_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMPI_MCA_rmaps_base_oversubscribe="1")  # root; fewer cores than processes
  return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                          start_new_session=True)


def _command_line(process: psutil.Process) -> str:
  """``process``'s command line, or "" once it is gone (or a zombie)."""
  try:
    return " ".join(process.cmdline())
  except psutil.Error:
    return ""


def _ended(process: psutil.Process) -> bool:
  """Whether ``process`` has exited (a zombie that its parent has not reaped counts)."""
  try:
    return process.status() == psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return True


def _kill_with_children(process):
  if process.poll() is None:
    for child in psutil.Process(process.pid).children(recursive=True):
      child.kill()
    process.kill()
  process.wait()


@pytest.mark.multiprocess
def test_the_docs_mpirun_command_matches_the_launcher_and_sigterm_leaves_one_checkpoint(
    tmp_path):
  if shutil.which("mpirun") is None:
    pytest.skip("Open MPI not installed (mpirun missing; Debian: apt-get install openmpi-bin)")
  command = shlex.split(docs_example("mpirun -np 2").replace("\\\n", " "))
  assert f"odls_base_sigkill_timeout {MPI_SIGKILL_TIMEOUT_S} " in " ".join(command)
  workdir = tmp_path / "run"

  def run(steps, log):
    return _mpirun([*command, f"--config.workdir={workdir}", f"--config.train.steps={steps}",
                    *COMMON], log)

  first_log, rerun_log = open(tmp_path / "first.log", "w"), open(tmp_path / "rerun.log", "w")
  first = rerun = None
  try:
    first = run(SCHEDULE, first_log)
    # The SIGTERM reaches the processes MPI_SIGKILL_TIMEOUT_S later. Sent once both have
    # started (train.py holds a stop signal from its first second on, and a run stops at
    # its first agreed step), it finds them training or about to: no need to wait for
    # their first step, and the fewer steps before the stop, the shorter the reference.
    deadline = time.monotonic() + 60
    while len(processes := [p for p in psutil.Process(first.pid).children(recursive=True)
                            if "train.py" in _command_line(p)]) < 2:
      assert first.poll() is None and time.monotonic() < deadline, "mpirun started no job"
      time.sleep(0.2)
    time.sleep(3)  # past their start-up to the point where they hold the signal
    first.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    # mpirun itself ends 2 x MPI_SIGKILL_TIMEOUT_S after its signal, whatever its processes
    # did (it reaps them only then): the test goes on once they have ended, and waits for
    # mpirun at the end.
    while not all(_ended(p) for p in processes):
      assert time.monotonic() - signalled < 2 * MPI_SIGKILL_TIMEOUT_S, (
          "mpirun's processes did not end before its SIGKILL")
      time.sleep(0.3)
    stopped = the_one_stop(workdir)

    rerun = run(stopped + RESUMED_STEPS, rerun_log)
    status = rerun.wait(timeout=120)
    output = (tmp_path / "rerun.log").read_text()
    assert status == 0, output[-3000:]
    assert f"resuming from step {stopped}" in output, output[-3000:]
    assert "process 1 of 2: 4 local devices, replicas [1]" in output, output[-3000:]
    assert_launcher_losses(workdir, tmp_path, stopped + RESUMED_STEPS)
    # The first mpirun, whose processes ended with their stop row and checkpoint, would only
    # print their output and exit 2 x MPI_SIGKILL_TIMEOUT_S after its signal: not waited for.
  finally:
    for job in (first, rerun):
      if job is not None:
        _kill_with_children(job)
    first_log.close()
    rerun_log.close()
