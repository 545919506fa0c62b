"""What a run shows: validation loss, compilation apart, the closing summary, TensorBoard."""

import glob
import struct

import numpy as np
from helpers import micro_config

from ntp_jax.data import make_dataset
from ntp_jax.parallel.step_modes import make_job_step
from ntp_jax.training.metrics import read_metrics
from ntp_jax.training.trainer import train


def _events(logdir):
  """Scalars of TensorBoard event files: {tag: [(step, value)]} (TFRecord framing)."""
  from tensorboardX.proto import event_pb2
  scalars = {}
  for path in glob.glob(f"{logdir}/events.out.tfevents.*"):
    data = open(path, "rb").read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack("<Q", data[at:at + 8])
      event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
      at += 12 + length + 4
      for value in event.summary.value:
        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
  return scalars


def test_validation_loss_summary_and_tensorboard(tmp_path):
  logged = []
  config = micro_config(tmp_path, **{"mesh.tp": 4, "ntp.failed": "1", "train.eval_every": 5,
                                    "train.eval_sequences": 16, "train.tensorboard": True})
  summary = train(config, log=logged.append)
  records = read_metrics(summary.metrics_path)
  assert [r["step"] for r in records if "val_loss" in r] == [4, 9]
  val = [r["val_loss"] for r in records if "val_loss" in r]
  assert val[1] < val[0] and all(np.isfinite(val))

  # The same held-out rows through the training program's loss (no update): equal.
  job = summary.programs[0]
  step = make_job_step(summary.plan, summary.programs)
  dataset = make_dataset(None, config.model.vocab_size, config.train.seq_len, str(tmp_path),
                         config.train.seed, max_corpus_bytes=config.data.max_corpus_bytes,
                         val_fraction=config.data.val_fraction)
  rows = dataset.validation.sequences(0, 16)
  assert job.replica_class.batch_rows == 16
  np.testing.assert_allclose(step.gradients_only(rows), val[1], rtol=1e-5)

  text = "\n".join(logged)
  def line_of(step):
    return next(line for line in logged if line.split("|")[0].split() == ["step", f"{step}/10"])
  assert "compile + step" in line_of(0) and "tok/s" not in line_of(0)
  assert "tok/s" in line_of(5)
  assert "| val " in line_of(4)
  closing = next(line for line in logged if line.startswith("summary: "))
  assert "10 steps" in closing and f"{10 * 16 * 32:,} tokens" in closing
  assert "tokens/s after compilation" in closing
  assert f"final loss {records[-1]['loss']:.4f}" in closing
  assert f"validation loss {val[1]:.4f}" in closing
  assert f"metrics: {summary.metrics_path}" in text

  scalars = _events(tmp_path / "tensorboard")
  assert [s for s, _ in scalars["train/loss"]] == list(range(10))
  np.testing.assert_allclose([v for _, v in scalars["train/loss"]],
                             [r["loss"] for r in records], rtol=1e-6)
  assert [s for s, _ in scalars["val/loss"]] == [4, 9]
  assert "train/tokens_per_s" in scalars and "goodput/goodput" in scalars


def test_every_run_ends_with_a_summary_even_without_validation(tmp_path):
  logged = []
  train(micro_config(tmp_path, **{"mesh.tp": 2, "train.steps": 3, "data.val_fraction": 0.0,
                                 "train.eval_every": 5}), log=logged.append)
  assert "validation: off (data.val_fraction=0 holds out no sequences)" in logged
  closing = next(line for line in logged if line.startswith("summary: "))
  assert "3 steps" in closing and "no validation loss" in closing
