"""``goodput.png`` of a run stopped by SIGTERM and resumed: drawn from both sessions of
``metrics.jsonl`` (``ntp_jax.training.run_plot``)."""

import os
import signal

from helpers import micro_config

from ntp_jax.training.run_plot import Mark, gather_series, run_title
from ntp_jax.training.trainer import train


def _config(workdir, steps):
  config = micro_config(workdir, **{"train.steps": steps, "train.eval_every": 2,
                                   "train.eval_sequences": 4, "checkpoint.every": 10})
  config.train.plot = True
  return config


def test_a_stopped_and_resumed_run_is_plotted_from_both_sessions(tmp_path):
  def sigterm_after_step_2(info):
    if info.step == 2:
      os.kill(os.getpid(), signal.SIGTERM)  # the run stops after this step, checkpointed

  first = train(_config(tmp_path, 6), log=lambda *_: None, hooks=[sigterm_after_step_2])
  assert first.interrupted and first.losses and len(first.losses) == 3
  lines = []
  second = train(_config(tmp_path, 6), log=lines.append)
  assert second.start_step == 3 and f"plot: {tmp_path / 'goodput.png'}" in lines
  assert os.path.getsize(tmp_path / "goodput.png") > 10_000

  series = gather_series(str(tmp_path / "metrics.jsonl"))
  assert series.steps == list(range(6)) and series.sessions == 2
  assert series.loss == first.losses + second.losses
  assert series.val_steps == [1, 3, 5]  # evaluated in both sessions
  assert series.tokens_per_s[0] is None and series.tokens_per_s[3] is None  # compiled
  assert series.marks == [Mark(3, "stop", "stop (SIGTERM)"), Mark(3, "resume", "resume at 3")]
  title = run_title(str(tmp_path), _config(tmp_path, 6).model, series)
  assert title == (f"{tmp_path}: models.gpt:model_spec (d_model 64, layers 2, vocab 512); "
                   "mesh 1 x 8, TP degrees 8, 2 sessions")
