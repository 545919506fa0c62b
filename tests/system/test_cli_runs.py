"""``train.py`` as a user runs it: the README's command, one-line errors with exit status 2,
SIGINT and SIGKILL during a run and its saves, and a checkpoint read by plain orbax on one
device."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import ROOT, micro_config, process_env

import configs.gpt_tiny
from ntp_jax.training.metrics import read_metrics, read_records
from ntp_jax.training.trainer import train


def _cli(*args, full_corpus=False, codegen=True, config="configs/gpt_micro.py", **popen):
  """``train.py --config CONFIG ARGS`` (on the first 300 kB of the corpus unless
  ``full_corpus``), its own device count, the run's compilation cache (``codegen``:
  ``helpers.process_env``)."""
  env = process_env(codegen=codegen)
  corpus = [] if full_corpus else ["--config.data.max_corpus_bytes=300000"]
  return subprocess.Popen([sys.executable, "train.py", "--config", config, *corpus, *args],
                          cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, **popen)


def _finish(proc, timeout=240):
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise
  return proc.returncode, out, err


def test_sigkill_during_an_async_save_resumes_from_the_last_complete_step(tmp_path):
  ckpt = tmp_path / "checkpoints"
  args = [f"--config.workdir={tmp_path}", "--config.train.steps=16",
          "--config.checkpoint.every=1", "--config.checkpoint.keep=3"]
  proc = _cli(*args)
  deadline = time.time() + 240
  caught = None
  try:
    while time.time() < deadline and proc.poll() is None:
      names = os.listdir(ckpt) if ckpt.exists() else []
      partial = [p for p in names if ".orbax-checkpoint-tmp" in p]
      if partial and len(names) > 2:
        proc.send_signal(signal.SIGKILL)
        caught = partial
        break
      time.sleep(0.002)
  finally:
    proc.kill()
    proc.communicate()
  assert caught, "no save was caught in flight"
  rc, out, err = _finish(_cli(*args))
  assert rc == 0, err[-3000:]
  assert "resuming from step" in out
  resumed_from = int(out.split("resuming from step ")[1].split()[0])
  assert f"{resumed_from}.orbax" not in " ".join(os.listdir(ckpt))  # no partial step remains
  rc, out, err = _finish(_cli(f"--config.workdir={tmp_path / 'whole'}", "--config.train.steps=16",
                              "--config.checkpoint.every=0"))
  assert rc == 0, err[-3000:]
  whole = [r["loss"] for r in read_metrics(tmp_path / "whole" / "metrics.jsonl")]
  parts = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")]
  assert len(parts) == 16
  np.testing.assert_array_equal(parts, whole)


def test_sigint_stops_after_the_step_with_one_line_and_whole_metrics(tmp_path):
  proc = _cli(f"--config.workdir={tmp_path}", "--config.train.steps=1000",
              "--config.checkpoint.every=500")
  metrics = tmp_path / "metrics.jsonl"
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and metrics.read_text().count('"loss"') >= 3:
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  rc, out, err = _finish(proc)
  assert rc == 0, err[-3000:]
  assert "Traceback" not in err
  last = out.strip().splitlines()[-1]
  assert last.startswith("interrupted at step ") and "checkpoint written to" in last, last
  step = int(last.split()[3])
  lines = metrics.read_text().splitlines()
  rows = [json.loads(line) for line in lines]  # every line whole
  assert rows[-1]["event"] == "stop" and rows[-1]["step"] == step
  assert os.path.isdir(tmp_path / "checkpoints" / str(step))
  # Resuming: says so, from which step and which plan.
  rc, out, err = _finish(_cli(f"--config.workdir={tmp_path}", f"--config.train.steps={step + 2}",
                              "--config.ntp.failed=3"))
  assert rc == 0, err[-3000:]
  assert f"resuming from step {step}" in out and "written under: mesh.dp=1 x mesh.tp=8" in out
  assert "7 live devices" in out


def test_sigint_during_compilation_ends_cleanly(tmp_path):
  proc = _cli(f"--config.workdir={tmp_path}", "--config.train.steps=50")
  deadline = time.time() + 240
  seen = ""
  while time.time() < deadline and "data:" not in seen:
    seen += proc.stdout.readline()
  proc.send_signal(signal.SIGINT)
  rc, out, err = _finish(proc)
  assert rc == 0 and "Traceback" not in err, err[-3000:]
  assert out.strip().splitlines()[-1].startswith("interrupted at step 0")


def test_plain_orbax_reads_the_checkpoint_on_one_device(tmp_path):
  """Written here on 8 devices, read by a process that has one and no ntp_jax."""
  config = micro_config(tmp_path, **{"train.steps": 2})
  config.checkpoint.every = 2
  train(config, log=lambda *_: None)
  script = f"""
import jax, orbax.checkpoint as ocp
assert len(jax.devices()) == 1
path = {str(tmp_path / 'checkpoints' / '2' / 'state')!r}
meta = ocp.StandardCheckpointer().metadata(path)
tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
state = ocp.StandardCheckpointer().restore(path, target)
print(state["params"]["embed"]["embedding"].shape,
      state["opt_state"]["0"]["nu"]["head"]["kernel"].shape)
"""
  env = process_env(JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(tmp_path))
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == "(512, 64) (64, 512)"


def test_default_tiny_run_lowers_the_loss(tmp_path):
  """The README's main command, as is (default steps and corpus), on simulated devices."""
  # As a user runs it: the production codegen (150 steps run faster so).
  proc = _cli(f"--config.workdir={tmp_path}", "--config.ntp.failed=3", full_corpus=True,
              codegen=False, config="configs/gpt_tiny.py")
  rc, out, err = _finish(proc)
  assert rc == 0, err[-3000:]
  losses = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")]
  assert len(losses) == configs.gpt_tiny.get_config().train.steps
  assert np.mean(losses[-10:]) < np.mean(losses[:5]) - 1.5, (losses[:5], losses[-10:])
  assert "TP degree 7" in out


@pytest.mark.parametrize("args,line", [
    (["--config", "configs/missing.py"], "error: --config: no config file configs/missing.py"),
    (["--config", "configs/gpt_tiny.py", "--config.train.steps=abc"],
     "error: train.steps: expected a whole number, got 'abc'"),
    (["--config", "configs/gpt_tiny.py", "--config.ntp.failed=9"],
     "error: ntp.failed: "),
])
def test_train_py_prints_one_line_and_exits_2(args, line):
  env = process_env()
  result = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.strip().startswith(line), result.stderr[-2000:]
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]


def test_a_restart_in_a_new_process_loads_every_step_program_it_compiled(tmp_path):
  """Two steps, then a resume to four in a new process, on one learning-rate curve and a
  compilation cache of the run's own: the first session compiles its class step, the second
  compiles none, it loads them (as the log line and the metrics row say)."""
  args = [f"--config.workdir={tmp_path}", f"--config.compile.cache_dir={tmp_path / 'cache'}",
          "--config.train.schedule_steps=4", "--config.train.eval_every=0"]
  rc, first, err = _finish(_cli(*args, "--config.train.steps=2"))
  assert rc == 0, err[-3000:]
  rc, second, err = _finish(_cli(*args, "--config.train.steps=4"))
  assert rc == 0, err[-3000:]
  assert "resuming from step 2" in second
  built = [r for r in read_records(tmp_path / "metrics.jsonl") if r.get("compiled")]
  assert [r["step"] for r in built] == [0, 2]
  assert built[0]["programs_compiled"] >= 1 and built[0]["programs_loaded"] == 0
  assert built[1]["programs_compiled"] == 0 and built[1]["programs_loaded"] >= 1, built[1]
  assert "  step 2: 0 program(s) compiled" in second, second
