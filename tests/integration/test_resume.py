"""Resume from checkpoints: exact losses, onto other plans, exact data position, bad input
(in this process; ``train.py`` stopped by signals: ``tests/system/test_cli_runs.py``)."""

import os
import shutil

import numpy as np
import pytest
from helpers import micro_config

from ntp_jax.data.packed_dataset import PackedDataset
from ntp_jax.errors import ConfigError
from ntp_jax.training.metrics import read_metrics, read_records
from ntp_jax.training.trainer import train


def run(workdir, steps, ckpt_dir, log=None, **overrides):
  """gpt_micro for ``steps`` steps, a checkpoint every 6 and at the end, under ``ckpt_dir``."""
  config = micro_config(workdir, **{"train.steps": steps, **overrides})
  config.checkpoint.every = 6
  config.checkpoint.dir = str(ckpt_dir)
  return train(config, log=log or (lambda *_: None))


@pytest.fixture(scope="module")
def data_workdir(tmp_path_factory):
  return tmp_path_factory.mktemp("resume")


# The parts of a run follow the 12-step run's learning-rate curve.
ONE_CURVE = {"train.schedule_steps": 12}


def test_resume_same_plan_gives_identical_losses(data_workdir, tmp_path):
  whole = run(data_workdir, 12, tmp_path / "whole", **ONE_CURVE).losses
  first = run(data_workdir, 6, tmp_path / "parts", **ONE_CURVE)
  assert first.checkpoint.endswith("6")
  second = run(data_workdir, 12, tmp_path / "parts", **ONE_CURVE)
  assert second.start_step == 6 and len(second.losses) == 6
  assert first.losses + second.losses == whole
  # (Onto another plan: the next test.)


def test_resume_onto_a_reduced_replica_matches_the_uninterrupted_run(data_workdir, tmp_path):
  mesh = {"mesh.dp": 2, "mesh.tp": 4, "ntp.rebalance": "equal", **ONE_CURVE}
  whole = run(data_workdir, 12, tmp_path / "whole", **mesh).losses
  run(data_workdir, 6, tmp_path / "parts", **mesh)
  resumed = run(data_workdir, 12, tmp_path / "parts", **mesh, **{"ntp.failed": "1:2"})
  assert [r.degree for r in resumed.plan.replicas] == [4, 3]
  np.testing.assert_allclose(resumed.losses, whole[6:], rtol=1e-5)
  records = read_metrics(resumed.metrics_path)
  assert [r["step"] for r in records] == list(range(12))
  assert [r["tp_degrees"] for r in records[5:7]] == [[4, 4], [4, 3]]
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


def test_a_finished_run_says_so(data_workdir, tmp_path):
  run(data_workdir, 3, tmp_path / "ckpt")
  lines = []
  again = run(data_workdir, 3, tmp_path / "ckpt", log=lines.append)
  assert again.losses == [] and "step 3 already reached train.steps=3; nothing to do" in lines


def test_checkpoint_of_another_model_and_a_damaged_one_are_one_line_errors(data_workdir,
                                                                           tmp_path):
  ckpt = tmp_path / "ckpt"
  run(data_workdir, 2, ckpt)
  with pytest.raises(ConfigError) as err:
    run(data_workdir, 4, ckpt, **{"model.d_ff": 256})
  text = str(err.value)
  assert text.startswith("checkpoint ") and "\n" not in text, text
  assert "params/blocks/mlp/down/kernel has shape (2, 192, 64)" in text
  assert "expects (2, 256, 64)" in text
  # Damage the data files of the checkpoint: a one-line error naming its folder.
  step_dir = ckpt / "2"
  data_files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir / "state") for f in fs
                if os.path.getsize(os.path.join(d, f)) > 10_000]
  _truncate(data_files)
  with pytest.raises(ConfigError) as err:
    run(data_workdir, 4, ckpt)
  assert str(err.value).startswith(f"checkpoint {step_dir}") and "\n" not in str(err.value)


def _truncate(paths, size=100):
  """Damage checkpoint files: each cut to ``size`` bytes."""
  assert paths
  for path in paths:
    with open(path, "r+b") as f:
      f.truncate(size)


def test_a_damaged_data_file_is_one_line_naming_the_cause_not_the_store(data_workdir, tmp_path):
  ckpt = tmp_path / "ckpt"
  run(data_workdir, 2, ckpt)
  chunks = [os.path.join(d, f) for d, _, fs in os.walk(ckpt / "2" / "state")
            if os.path.basename(d) == "d" and "ocdbt" in d for f in fs
            if os.path.getsize(os.path.join(d, f)) > 100_000]  # array data, not metadata
  _truncate(chunks)
  with pytest.raises(ConfigError) as err:
    run(data_workdir, 4, ckpt)
  text = str(err.value)
  assert text.startswith(f"checkpoint {ckpt / '2'}: a data file is missing or damaged "
                         "(ValueError: OUT_OF_RANGE: Error reading "), text
  assert "TensorStore details" not in text and "<bound method" not in text, text


def test_checkpoint_dir_that_is_a_file_is_a_one_line_error(data_workdir, tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(ConfigError, match=r"^checkpoint.dir:"):
    run(data_workdir, 2, tmp_path / "file")


def test_a_checkpoint_of_another_seq_len_stops_before_a_tokenizer_is_trained(tmp_path):
  """Another sequence length in the same workdir: refused on train.seq_len before its BPE is
  trained."""
  run(tmp_path, 1, tmp_path / "checkpoints")
  entries = sorted(os.listdir(tmp_path / "data"))
  with pytest.raises(ConfigError, match=r"^train.seq_len: the checkpoint .* train.seq_len=32"):
    run(tmp_path, 2, tmp_path / "checkpoints",
        **{"train.seq_len": 16, "model.vocab_size": 1024})
  assert sorted(os.listdir(tmp_path / "data")) == entries  # no tokenizer of 1,024 tokens


def test_a_checkpoint_of_another_vocabulary_stops_before_a_tokenizer_is_trained(tmp_path):
  run(tmp_path, 1, tmp_path / "checkpoints")
  entries = sorted(os.listdir(tmp_path / "data"))
  with pytest.raises(ConfigError, match=r"^checkpoint .*/1: params/embed/embedding has shape "
                                        r"\(512, 64\), the model expects \(1024, 64\)$"):
    run(tmp_path, 2, tmp_path / "checkpoints", **{"model.vocab_size": 1024})
  assert sorted(os.listdir(tmp_path / "data")) == entries  # no tokenizer of 1,024 tokens


def test_a_fresh_run_into_another_runs_checkpoints_is_refused_and_touches_nothing(
    data_workdir, tmp_path):
  """checkpoint.resume=False where checkpoints are: one line, nothing deleted or written (its
  saves would delete the oldest step, and the next resume would continue the old run)."""
  ckpt = tmp_path / "ckpt"
  run(data_workdir, 7, ckpt)  # steps 6 and 7
  before = sorted(os.listdir(ckpt))
  metrics = (data_workdir / "metrics.jsonl").read_text()
  with pytest.raises(ConfigError) as err:
    run(data_workdir, 2, ckpt, **{"checkpoint.resume": False})
  assert str(err.value) == (
      f"checkpoint.resume=False: {ckpt} holds checkpoints of an earlier run (steps 6, 7); a "
      "fresh run needs a folder of its own: set checkpoint.dir (or workdir) to a new folder, "
      "or move that one aside")
  assert sorted(os.listdir(ckpt)) == before
  assert (data_workdir / "metrics.jsonl").read_text() == metrics


def test_a_run_in_parts_on_one_schedule_equals_the_whole_run(data_workdir, tmp_path):
  """train.schedule_steps=10: 6 steps, then resumed to 10, follow the 10-step run's rate."""
  lr = {"train.warmup_steps": 2}
  own = {"train.schedule_steps": 0}  # the curve of the run's own steps (gpt_micro pins one)
  whole = run(data_workdir, 10, tmp_path / "whole", **lr, **own).losses
  first = run(data_workdir, 6, tmp_path / "parts", **lr, **{"train.schedule_steps": 10})
  shutil.copytree(tmp_path / "parts", tmp_path / "parts_other")
  lines = []
  config = micro_config(data_workdir, **{"train.steps": 10, "train.schedule_steps": 10, **lr})
  config.checkpoint.every, config.checkpoint.dir = 10, str(tmp_path / "parts")
  second = train(config, log=lines.append)
  assert second.start_step == 6
  np.testing.assert_allclose(first.losses + second.losses, whole, rtol=0, atol=1e-6)
  assert not [line for line in lines if "schedule" in line]
  # Resumed with another schedule (train.steps=8 and no schedule_steps): one line says so.
  lines.clear()
  config = micro_config(data_workdir, **{"train.steps": 8, **lr, **own})
  config.checkpoint.every, config.checkpoint.dir = 10, str(tmp_path / "parts_other")
  train(config, log=lines.append)
  warned = [line for line in lines if "schedule" in line]
  assert len(warned) == 1 and "train.schedule_steps=10 -> 8" in warned[0], lines
