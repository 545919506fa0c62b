"""Resume from checkpoints: exact losses, onto other plans, exact data position, bad input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import ROOT, tiny_config

from ntp_jax.data.packed_dataset import PackedDataset
from ntp_jax.errors import ConfigError
from ntp_jax.train.metrics import read_metrics, read_records
from ntp_jax.train.trainer import train

QUIET = dict(log=lambda *_: None)


def run(workdir, steps, ckpt_dir, **overrides):
  config = tiny_config(workdir, **{"train.steps": steps, **overrides})
  config.checkpoint.every = 10
  config.checkpoint.dir = str(ckpt_dir)
  return train(config, **QUIET)


@pytest.fixture(scope="module")
def data_workdir(tmp_path_factory):
  return tmp_path_factory.mktemp("resume")


def test_resume_same_plan_gives_identical_losses(data_workdir, tmp_path):
  whole = run(data_workdir, 40, tmp_path / "whole").losses
  first = run(data_workdir, 20, tmp_path / "parts")
  assert first.checkpoint.endswith("20")
  shutil.copytree(tmp_path / "parts", tmp_path / "parts_reduced")
  second = run(data_workdir, 40, tmp_path / "parts")
  assert second.start_step == 20 and len(second.losses) == 20
  assert first.losses + second.losses == whole
  # Onto a plan with one slot failed: same sequences, another layout.
  reduced = run(data_workdir, 40, tmp_path / "parts_reduced", **{"ntp.failed": "3"})
  assert [r.degree for r in reduced.plan.replicas] == [7]
  np.testing.assert_allclose(reduced.losses, whole[20:], rtol=1e-5)


def test_resume_onto_a_reduced_replica_matches_the_uninterrupted_run(data_workdir, tmp_path):
  mesh = {"mesh.dp": 2, "mesh.tp": 4, "ntp.rebalance": "equal"}
  whole = run(data_workdir, 40, tmp_path / "whole", **mesh).losses
  run(data_workdir, 20, tmp_path / "parts", **mesh)
  resumed = run(data_workdir, 40, tmp_path / "parts", **mesh, **{"ntp.failed": "1:2"})
  assert [r.degree for r in resumed.plan.replicas] == [4, 3]
  np.testing.assert_allclose(resumed.losses, whole[20:], rtol=1e-5)
  records = read_metrics(resumed.metrics_path)
  assert [r["step"] for r in records] == list(range(40))
  assert [r["tp_degrees"] for r in records[19:21]] == [[4, 4], [4, 3]]
  events = [r["event"] for r in read_records(resumed.metrics_path) if "event" in r]
  assert events[-4:] == ["start", "end", "resume", "end"]


def test_every_sequence_once_when_the_plan_loses_devices(data_workdir, tmp_path, monkeypatch):
  """Proportional shares: 16 sequences per step, then 14 after a slot fails at the resume;
  read replica by replica."""
  calls = []
  original = PackedDataset.sequences

  def recording(self, cursor, count):
    if self.split == "train":  # not the held-out rows of a validation loss
      calls.append((self, cursor, count))
    return original(self, cursor, count)

  monkeypatch.setattr(PackedDataset, "sequences", recording)
  mesh = {"mesh.dp": 2, "mesh.tp": 4}
  run(data_workdir, 5, tmp_path / "c", **mesh)
  run(data_workdir, 11, tmp_path / "c", **mesh, **{"ntp.failed": "0:1"})
  # Each replica's rows are read by themselves (a process reads only its replicas' rows).
  counts = [count for _, _, count in calls]
  assert [a + b for a, b in zip(counts[::2], counts[1::2])] == [16] * 5 + [14] * 6
  assert set(counts[10:]) == {8, 6}  # the replica at TP degree 3 takes 6 of 14
  calls.sort(key=lambda call: call[1])
  ids = np.concatenate([d.sequence_ids(cursor, count) for d, cursor, count in calls])
  total = 5 * 16 + 6 * 14
  assert len(set(ids.tolist())) == len(ids) == total  # none skipped, none twice
  dataset = calls[-1][0]
  assert total < dataset.num_sequences
  # The two parts are one contiguous walk of the seeded order.
  np.testing.assert_array_equal(ids, dataset.sequence_ids(0, total))


def _cli(*args, **popen):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  return subprocess.Popen([sys.executable, "train.py", "--config", "configs/gpt_tiny.py",
                           "--config.data.max_corpus_bytes=300000", *args],
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
  args = [f"--config.workdir={tmp_path}", "--config.train.steps=30",
          "--config.checkpoint.every=1", "--config.checkpoint.keep=3"]
  proc = _cli(*args)
  deadline = time.time() + 240
  caught = None
  try:
    while time.time() < deadline and proc.poll() is None:
      names = os.listdir(ckpt) if ckpt.exists() else []
      partial = [p for p in names if ".orbax-checkpoint-tmp" in p]
      done = [p for p in os.listdir(ckpt)] if ckpt.exists() else []
      if partial and len(done) > 2:
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
  rc, out, err = _finish(_cli(f"--config.workdir={tmp_path / 'whole'}", "--config.train.steps=30",
                              "--config.checkpoint.every=0"))
  assert rc == 0, err[-3000:]
  whole = [r["loss"] for r in read_metrics(tmp_path / "whole" / "metrics.jsonl")]
  parts = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")]
  assert len(parts) == 30
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


def test_a_finished_run_says_so(tmp_path):
  args = [f"--config.workdir={tmp_path}", "--config.train.steps=3"]
  assert _finish(_cli(*args))[0] == 0
  rc, out, err = _finish(_cli(*args))
  assert rc == 0 and "already reached train.steps=3" in out


def test_checkpoint_of_another_model_and_a_damaged_one_are_one_line_errors(tmp_path):
  assert _finish(_cli(f"--config.workdir={tmp_path}", "--config.train.steps=2"))[0] == 0
  rc, out, err = _finish(_cli(f"--config.workdir={tmp_path}", "--config.train.steps=4",
                              "--config.model.d_ff=256"))
  assert rc == 2
  assert err.strip().splitlines()[-1].startswith("error: checkpoint "), err[-2000:]
  assert "params/blocks/mlp/down/kernel has shape (2, 384, 128)" in err
  assert "expects (2, 256, 128)" in err and "Traceback" not in err
  # Damage the data files of the checkpoint: a one-line error naming its folder.
  step_dir = tmp_path / "checkpoints" / "2"
  data_files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir / "state") for f in fs
                if os.path.getsize(os.path.join(d, f)) > 10_000]
  assert data_files
  for path in data_files:
    with open(path, "r+b") as f:
      f.truncate(100)
  rc, out, err = _finish(_cli(f"--config.workdir={tmp_path}", "--config.train.steps=4"))
  assert rc == 2 and "Traceback" not in err
  assert err.strip().splitlines()[-1].startswith(f"error: checkpoint {step_dir}"), err[-2000:]


def test_checkpoint_dir_that_is_a_file_is_a_one_line_error(tmp_path):
  (tmp_path / "file").write_text("x")
  rc, out, err = _finish(_cli(f"--config.workdir={tmp_path}",
                              f"--config.checkpoint.dir={tmp_path / 'file'}"))
  assert rc == 2
  assert err.strip().splitlines()[-1].startswith("error: checkpoint.dir:"), err[-2000:]


def test_plain_orbax_reads_the_checkpoint_on_one_device(tmp_path):
  assert _finish(_cli(f"--config.workdir={tmp_path}", "--config.train.steps=2"))[0] == 0
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
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env, cwd=str(tmp_path))
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == "(2048, 128) (128, 2048)"


def test_a_checkpoint_of_another_seq_len_stops_before_a_tokenizer_is_trained(tmp_path):
  """gpt_small in gpt_tiny's workdir: refused on train.seq_len before its BPE is trained."""
  run(tmp_path, 1, tmp_path / "checkpoints")
  entries = sorted(os.listdir(tmp_path / "data"))
  with pytest.raises(ConfigError, match=r"^train.seq_len: the checkpoint .* train.seq_len=64"):
    run(tmp_path, 2, tmp_path / "checkpoints",
        **{"train.seq_len": 32, "model.vocab_size": 1024})
  assert sorted(os.listdir(tmp_path / "data")) == entries  # no tokenizer of 1,024 tokens


def test_a_run_in_parts_on_one_schedule_equals_the_whole_run(data_workdir, tmp_path):
  """train.schedule_steps=10: 6 steps, then resumed to 10, follow the 10-step run's rate."""
  lr = {"train.warmup_steps": 2}
  whole = run(data_workdir, 10, tmp_path / "whole", **lr).losses
  first = run(data_workdir, 6, tmp_path / "parts", **lr, **{"train.schedule_steps": 10})
  shutil.copytree(tmp_path / "parts", tmp_path / "parts_other")
  lines = []
  config = tiny_config(data_workdir, **{"train.steps": 10, "train.schedule_steps": 10, **lr})
  config.checkpoint.every, config.checkpoint.dir = 10, str(tmp_path / "parts")
  second = train(config, log=lines.append)
  assert second.start_step == 6
  np.testing.assert_allclose(first.losses + second.losses, whole, rtol=0, atol=1e-6)
  assert not [line for line in lines if "schedule" in line]
  # Resumed with another schedule (train.steps=8 and no schedule_steps): one line says so.
  lines.clear()
  config = tiny_config(data_workdir, **{"train.steps": 8, **lr})
  config.checkpoint.every, config.checkpoint.dir = 10, str(tmp_path / "parts_other")
  train(config, log=lines.append)
  warned = [line for line in lines if "schedule" in line]
  assert len(warned) == 1 and "train.schedule_steps=10 -> 8" in warned[0], lines
