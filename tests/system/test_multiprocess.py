"""Multi-process jobs (jax.distributed on 127.0.0.1, gloo): the same losses as one process,
a lost process stops the others, and a restart on fewer devices resumes.

Every process started here runs under a timeout and is killed by id at the end.
"""

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import ROOT, micro_config, process_env

from ntp_jax.errors import ConfigError
from ntp_jax.launch import free_port
from ntp_jax.processes.distributed import (
  ENV_COORDINATOR,
  ENV_NUM_PROCESSES,
  ENV_PROCESS_ID,
  check_domains,
  settings_from_config,
)
from ntp_jax.processes.heartbeat import LOST_EXIT_CODE, Heartbeat, StopAgreement
from ntp_jax.training.config import RunConfig
from ntp_jax.training.metrics import read_metrics
from ntp_jax.training.trainer import train

FakeDevice = collections.namedtuple("FakeDevice", "id process_index")
PLAN = ["--config.mesh.dp=2", "--config.mesh.tp=4", "--config.ntp.failed=1:2"]
STEPS = 4


def _train_args(workdir, *extra):
  return [sys.executable, "train.py", "--config", "configs/gpt_micro.py", *PLAN,
          f"--config.workdir={workdir}", "--config.train.plot=False",
          "--config.train.eval_every=0", "--config.data.max_corpus_bytes=300000",
          "--config.train.log_every=1", *extra]


def _launch(processes, workdir, *extra, timeout=420):
  command = [sys.executable, "-m", "ntp_jax.launch", f"--processes={processes}", "--",
             *_train_args(workdir, *extra)]
  return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                        env=process_env())


def _losses(workdir):
  return [r["loss"] for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
  """The same plan in this one process (8 devices): STEPS steps, then a resume to STEPS + 2
  (gpt_micro's one learning-rate curve: both runs follow it, as the two processes do)."""
  workdir = tmp_path_factory.mktemp("single")
  plan = {"mesh.dp": 2, "mesh.tp": 4, "ntp.failed": "1:2", "checkpoint.every": 2}
  first = train(micro_config(workdir, **plan, **{"train.steps": STEPS}), log=lambda *_: None)
  resumed = train(micro_config(workdir, **plan, **{"train.steps": STEPS + 2}),
                  log=lambda *_: None)
  assert resumed.start_step == STEPS
  return first.losses + resumed.losses


@pytest.mark.multiprocess
def test_two_processes_of_four_devices_equal_one_process(tmp_path, single_process_losses):
  done = _launch(2, tmp_path, f"--config.train.steps={STEPS}", "--config.checkpoint.every=2")
  assert done.returncode == 0, done.stdout[-3000:]
  # Output is prefixed per process; only process 0 writes metrics and speaks for the job.
  assert "[1] process 1 of 2: 4 local devices, replicas [1]" in done.stdout
  assert f"[0] step {STEPS - 1}/{STEPS}" in done.stdout
  assert f"[1] step {STEPS - 1}/{STEPS}" not in done.stdout
  np.testing.assert_allclose(_losses(tmp_path), single_process_losses[:STEPS], rtol=1e-6)
  # Both processes wrote the checkpoint and both read it back: the run goes on as one would.
  resumed = _launch(2, tmp_path, f"--config.train.steps={STEPS + 2}",
                    "--config.checkpoint.every=2")
  assert resumed.returncode == 0, resumed.stdout[-3000:]
  assert f"[0] resuming from step {STEPS}" in resumed.stdout
  np.testing.assert_allclose(_losses(tmp_path), single_process_losses, rtol=1e-6)


@pytest.mark.multiprocess
def test_checkpoints_refused_where_a_process_would_hold_no_piece(tmp_path):
  done = _launch(4, tmp_path, "--config.train.steps=1", "--config.checkpoint.every=1",
                 "--config.distributed.processes_per_domain=2", timeout=180)
  assert done.returncode == 2, done.stdout[-3000:]
  assert "error: checkpoint.every: process 1 would hold no piece of" in done.stdout


@pytest.mark.multiprocess
def test_checkpoints_refused_at_start_where_an_event_leads_to_such_a_plan(tmp_path):
  """TP 8 over two processes: healthy, each holds a piece of every array; once slot 6
  fails, process 1 would not. Refused before the first step, not at step 10."""
  done = _launch(2, tmp_path, "--config.train.steps=12", "--config.checkpoint.every=5",
                 "--config.mesh.dp=1", "--config.mesh.tp=8", "--config.ntp.failed=",
                 "--config.ntp.fail_at=10@0:6",
                 "--config.distributed.processes_per_domain=2", timeout=180)
  assert done.returncode == 2, done.stdout[-3000:]
  assert ("error: checkpoint.every: process 1 would hold no piece of opt_state/0/mu/blocks/"
          "attn/wk on the plan after the event fail 10@0:6") in done.stdout
  assert "step 0" not in done.stdout  # no step ran


def test_tp_group_across_hosts_needs_processes_per_domain():
  """4 processes of 2 devices, TP 4: a group spans two processes, one domain only if said so."""
  devices = [FakeDevice(id=i, process_index=i // 2) for i in range(8)]
  check_domains(devices, tp=4, dp=2, processes_per_domain=2)
  with pytest.raises(ConfigError, match=r"mesh.tp: replica 0's 4 slots would span scale-up "
                     r"domains \[0, 1\] .* set distributed.processes_per_domain to 2"):
    check_domains(devices, tp=4, dp=2, processes_per_domain=1)


def _start(process_id, workdir, port, *extra):
  env = process_env(**{ENV_COORDINATOR: f"127.0.0.1:{port}", ENV_NUM_PROCESSES: "2",
                ENV_PROCESS_ID: str(process_id), "PYTHONUNBUFFERED": "1"})
  log = open(os.path.join(workdir, f"process{process_id}.log"), "w")
  return subprocess.Popen(_train_args(workdir, *extra), cwd=ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True), log


def _stop(process):
  if process.poll() is None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.multiprocess
def test_a_process_killed_at_any_point_stops_the_survivor_and_a_smaller_restart_resumes(tmp_path):
  """SIGKILL from outside, wherever process 1 is (a step, a collective save): process 0 names
  the lost process within the heartbeat's timeout; a restart on its four devices resumes
  from the last periodic checkpoint the two processes wrote, resharded onto one replica."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  timeout_s = 4
  extra = ["--config.train.steps=40", "--config.checkpoint.every=2",
           f"--config.distributed.heartbeat_timeout_s={timeout_s}"]
  port = free_port()
  (p0, log0), (p1, log1) = (_start(i, workdir, port, *extra) for i in range(2))
  try:
    checkpoint = workdir / "checkpoints" / "4"
    deadline = time.monotonic() + 300
    while not (checkpoint / "_CHECKPOINT_METADATA").exists():
      assert p0.poll() is None and p1.poll() is None, (workdir / "process0.log").read_text()
      assert time.monotonic() < deadline, "no checkpoint of step 4 in 300 s"
      time.sleep(0.2)
    os.kill(p1.pid, signal.SIGKILL)  # process 1 dies in the middle of training
    killed = time.monotonic()
    status = p0.wait(timeout=60)
    stopped_in = time.monotonic() - killed
  finally:
    for process, log in ((p0, log0), (p1, log1)):
      _stop(process)
      log.close()
  output = (workdir / "process0.log").read_text()
  assert status == LOST_EXIT_CODE, output[-2000:]
  assert "error: lost process 1 of 2" in output, output[-2000:]
  assert stopped_in < 3 * timeout_s + 5, stopped_in

  latest = max(int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit())
  reference = tmp_path / "reference"
  shutil.copytree(workdir / "checkpoints", reference / "checkpoints")
  smaller = ["--config.mesh.dp=1", "--config.ntp.failed=", f"--config.train.steps={latest + 2}"]
  resumed = subprocess.run(_train_args(workdir, "--config.checkpoint.every=2", *smaller),
                           cwd=ROOT, capture_output=True, text=True, timeout=300, env=process_env())
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resuming from step {latest}" in resumed.stdout
  # The same resume from a copy of that checkpoint, in this process: the same losses.
  config = micro_config(reference, **{"mesh.dp": 1, "mesh.tp": 4, "train.steps": latest + 2,
                                     "checkpoint.every": 2})
  expected = train(config, log=lambda *_: None).losses
  records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
  after = [r["loss"] for r in records if "loss" in r and r["step"] >= latest][-2:]
  np.testing.assert_allclose(after, expected, rtol=1e-6)


@pytest.mark.multiprocess
def test_uneven_collectives_across_processes_equal_numpy():
  """All-gather and reduce-scatter of uneven float64 blocks over gloo, 10 repetitions."""
  command = [sys.executable, "-m", "ntp_jax.launch", "--processes=2", "--devices-per-process=4",
             "--", sys.executable, "tests/programs/gloo_collectives.py", "10"]
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                        env=process_env())
  assert done.returncode == 0, done.stdout[-3000:]
  for i in range(2):
    assert f"[{i}] process {i}: 10 repetitions equal numpy" in done.stdout


def test_settings_from_config_and_launcher_variables():
  config = micro_config("/tmp/unused")

  def settings_from(config, environ):
    return settings_from_config(RunConfig.from_config(config).distributed, environ=environ)

  assert settings_from(config, environ={}) is None  # one process
  launched = settings_from(config, environ={ENV_COORDINATOR: "127.0.0.1:1234",
                                        ENV_NUM_PROCESSES: "2", ENV_PROCESS_ID: "1"})
  assert (launched.coordinator, launched.num_processes, launched.process_id) == (
      "127.0.0.1:1234", 2, 1)
  assert settings_from(config, environ={"SLURM_NTASKS": "4"}) is None  # sbatch's script
  slurm = settings_from(config, environ={"SLURM_STEP_NUM_TASKS": "4"})  # under srun
  assert slurm.coordinator is None and slurm.num_processes is None  # jax.distributed detects
  config.distributed.num_processes = 2
  with pytest.raises(ConfigError, match="distributed.coordinator: required"):
    settings_from(config, environ={})
  config.distributed.coordinator = "127.0.0.1:1234"
  with pytest.raises(ConfigError, match=r"distributed.process_id: must be in 0..1, got -1"):
    settings_from(config, environ={})


@pytest.mark.multiprocess
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
  """Preemption reaches one process: both stop at one agreed step and write its checkpoint."""
  extra = ["--config.train.steps=400", "--config.checkpoint.every=50"]
  port = free_port()
  (p0, log0), (p1, log1) = (_start(i, tmp_path, port, *extra) for i in range(2))
  try:
    deadline = time.monotonic() + 300
    while not (tmp_path / "metrics.jsonl").exists() or '"step": 2' not in (
        tmp_path / "metrics.jsonl").read_text():
      assert p0.poll() is None and p1.poll() is None, (tmp_path / "process0.log").read_text()
      assert time.monotonic() < deadline, "no step 2 in 300 s"
      time.sleep(0.2)
    os.kill(p1.pid, signal.SIGTERM)
    statuses = [p.wait(timeout=120) for p in (p0, p1)]
  finally:
    for process, log in ((p0, log0), (p1, log1)):
      _stop(process)
      log.close()
  output = (tmp_path / "process0.log").read_text()
  assert statuses == [0, 0], output[-3000:]
  stopped = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")
             if '"event": "stop"' in line]
  assert len(stopped) == 1 and stopped[0]["signal"] == "SIGTERM (another process)"
  step = stopped[0]["step"]
  assert os.path.isdir(tmp_path / "checkpoints" / str(step))
  assert f"interrupted at step {step}" in output


class FakeKeyValueStore:
  """The coordination service's key-value calls that the heartbeat makes, in memory."""

  def __init__(self):
    self.values = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    if key in self.values and not allow_overwrite:
      raise RuntimeError(f"ALREADY_EXISTS: {key}")
    self.values[key] = value

  def key_value_try_get(self, key):
    if key not in self.values:
      raise RuntimeError(f"NOT_FOUND: {key}")
    return self.values[key]


def test_heartbeat_names_a_silent_peer_and_spares_a_finished_one():
  store, lost = FakeKeyValueStore(), []
  store.key_value_set("ntp_jax/done/2", "1")  # process 2 ended normally
  beat = Heartbeat(store, 0, 3, timeout_s=0.3, on_lost=lost.append).start()
  try:
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
      time.sleep(0.05)
  finally:
    beat.stop()
  assert len(lost) == 1 and lost[0].startswith("lost process 1 of 3: no heartbeat for ")
  assert "distributed.heartbeat_timeout_s=0.3" in lost[0]


def test_stop_agreement_gives_every_process_the_same_step():
  store = FakeKeyValueStore()
  first, second = StopAgreement(store), StopAgreement(store)
  assert first.due(5, None) is None
  assert second.due(7, "SIGTERM") is None  # published: stop before step 9
  assert first.due(8, None) is None and first.due(9, None) == "SIGTERM"
  assert first.due(8, "SIGINT") is None  # a later request does not move the agreed step
  assert second.due(9, "SIGTERM") == "SIGTERM"


@pytest.mark.multiprocess
def test_ctrl_c_to_the_launcher_stops_every_process_with_one_checkpoint_and_status_0(tmp_path):
  """A Ctrl-C (SIGINT) to ``python -m ntp_jax.launch`` is passed on once to each process:
  they stop at one agreed step, write its checkpoint, and the launcher's status is 0."""
  command = [sys.executable, "-m", "ntp_jax.launch", "--processes=2", "--",
             *_train_args(tmp_path, "--config.train.steps=400", "--config.checkpoint.every=1000")]
  launcher = subprocess.Popen(command, cwd=ROOT, env=process_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    deadline = time.monotonic() + 300
    while not (tmp_path / "metrics.jsonl").exists() or '"step": 1,' not in (
        tmp_path / "metrics.jsonl").read_text():
      assert launcher.poll() is None, launcher.stdout.read()[-3000:]
      assert time.monotonic() < deadline, "no step 1 in 300 s"
      time.sleep(0.2)
    launcher.send_signal(signal.SIGINT)
    status = launcher.wait(timeout=120)
    output = launcher.stdout.read()
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
      launcher.wait()
  assert status == 0, output[-3000:]
  stopped = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")
             if '"event": "stop"' in line]
  assert len(stopped) == 1 and stopped[0]["signal"] == "SIGINT", output[-3000:]
  step = stopped[0]["step"]
  assert sorted(p for p in os.listdir(tmp_path / "checkpoints") if p.isdigit()) == [str(step)]
  assert f"[0] interrupted at step {step} (SIGINT)" in output
