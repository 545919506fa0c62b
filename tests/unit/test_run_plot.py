"""``goodput.png`` covers the whole run across resumes (``ntp_jax.train.run_plot``): the series
are gathered from every session of ``metrics.jsonl``."""

import json
import os
import signal

from helpers import tiny_config

from ntp_jax.train.run_plot import Mark, gather_series, run_title
from ntp_jax.train.trainer import train


def _config(workdir, steps):
  config = tiny_config(workdir, **{"train.steps": steps, "train.eval_every": 2,
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
  assert title == (f"{tmp_path}: models.gpt:model_spec (d_model 128, layers 2, vocab 2,048); "
                   "mesh 1 x 8, TP degrees 8, 2 sessions")


def test_crashes_failures_and_repairs_are_marked_and_redone_steps_drawn_once(tmp_path):
  plan = {"tp": 4, "dp": 2, "replicas": [{"live_slots": [0, 1, 2, 3]}] * 2}
  reduced = {**plan, "replicas": [{"live_slots": [0, 1, 2, 3]}, {"live_slots": [0, 1, 3]}]}
  step = lambda s, loss: {"step": s, "loss": loss, "tokens": 100, "step_time_s": 0.5}  # noqa: E731
  rows = [{"event": "start", "step": 0, "plan": {"tp": 9}}, step(0, 9.0),
          {"event": "end", "step": 1},
          {"event": "start", "step": 0, "plan": plan}, step(0, 5.0), step(1, 4.0),
          {"event": "fail", "step": 2, "replica": 1, "slot": 2, "mid": True}, step(2, 3.5),
          # a crash: no stop row; the resume redoes step 2
          {"event": "resume", "step": 2, "plan": reduced}, step(2, 3.0),
          {"event": "repair", "step": 3, "replica": 1, "slot": 2}, step(3, 2.0)]
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  series = gather_series(str(path))
  assert series.steps == [0, 1, 2, 3] and series.loss == [5.0, 4.0, 3.0, 2.0]  # the last run
  assert series.tokens_per_s == [200.0] * 4
  assert [(m.kind, m.label) for m in series.marks] == [
      ("fail", "fail 2.mid@1:2"), ("resume", "resume at 2 after a crash"),
      ("repair", "repair 3@1:2")]
  title = run_title("runs/x", {"factory": "examples.mlp_lm:model_spec"}, series)
  assert title == ("runs/x: examples.mlp_lm:model_spec; mesh 2 x 4, TP degrees 4,4 -> 4,3, "
                   "2 sessions")
