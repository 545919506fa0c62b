"""Step hooks added from Python: they see every step, in order, and can inject failures."""

import os

import numpy as np
import pytest
from helpers import micro_config

from ntp_jax.resilience.events import Event
from ntp_jax.training.hooks import Hook, RunServices, StepInfo
from ntp_jax.training.loop import TrainingRun
from ntp_jax.training.metrics import read_metrics, read_records
from ntp_jax.training.trainer import train


class Recorder(Hook):
  """Records what it is shown; ``every`` as given; fails replica 0 slot 1 before step 4."""

  def __init__(self, every=1, fail_before=None):
    self.every, self.fail_before = every, fail_before
    self.seen: list[StepInfo] = []
    self.asked: list[int] = []
    self.ended = 0

  def before_step(self, step, services):
    self.asked.append(step)
    if step == self.fail_before:
      return [Event(step, False, "fail", 0, 1)]
    return []

  def on_step(self, info):
    self.seen.append(info)

  def on_end(self, services):
    self.ended += 1


class ReachesForTheTrainer(Hook):
  """A hook that looks for the trainer in what it is given: it must find none."""

  def __init__(self):
    self.found, self.errors = [], []

  def on_step(self, info):
    try:
      info.run  # noqa: B018  (the field hooks used to get)
    except AttributeError as err:
      self.errors.append(str(err))
    given = [*vars(info).values(), *vars(info.services).values()]
    self.found += [v for v in given if isinstance(v, TrainingRun)]


def test_hooks_from_python_see_every_step_and_the_complete_record(tmp_path):
  steps = 6
  config = micro_config(tmp_path, **{"train.steps": steps, "mesh.dp": 2, "mesh.tp": 4})
  every_step, every_third = Recorder(fail_before=4), Recorder(every=3)
  plain, nosy = [], ReachesForTheTrainer()
  result = train(config, log=lambda *_: None,
                 hooks=[every_step, every_third, lambda info: plain.append(info.step), nosy])
  assert [i.step for i in every_step.seen] == list(range(steps)) == plain
  assert [i.done for i in every_third.seen] == [3, 6]
  assert every_step.asked == list(range(steps)) and every_step.ended == 1
  assert [i.loss for i in every_step.seen] == result.losses
  records = read_metrics(result.metrics_path)
  for info, record in zip(every_step.seen, records):
    # User hooks run after the defaults: the record is the one written, goodput included.
    assert info.record == record and "goodput" in info.record
    assert info.tokens == info.plan.global_batch * config.train.seq_len
    assert info.step_time_s > 0 and np.isfinite(info.grad_norm)
  # The failure the hook reported before step 4 changed the plan from that step on.
  degrees = [[r.degree for r in i.plan.replicas] for i in every_step.seen]
  assert degrees == [[4, 4]] * 4 + [[3, 4]] * 2
  assert every_step.seen[0].compiled and not every_step.seen[1].compiled
  # Hooks get the step's facts and the services they may use, never the trainer itself.
  assert len(nosy.errors) == steps and not nosy.found
  assert all(isinstance(i.services, RunServices) for i in every_step.seen)


class RaisesAt(Hook):
  """Raises ``ValueError`` after step ``step``: a bug in the caller's hook."""

  def __init__(self, step):
    self.step = step

  def on_step(self, info):
    if info.step == self.step:
      raise ValueError(f"bug at step {info.step}")


def test_a_hook_that_raises_stops_the_run_with_a_checkpoint_and_a_stop_row(tmp_path):
  # No periodic checkpoint before the hook raises: only the stop can save the 4 steps done.
  config = micro_config(tmp_path, **{"train.steps": 6, "mesh.tp": 2, "checkpoint.every": 10})
  lines = []
  with pytest.raises(ValueError, match="bug at step 3"):
    train(config, log=lambda line, *_, **__: lines.append(line), hooks=[RaisesAt(3)])
  checkpoint = os.path.join(tmp_path, "checkpoints", "4")
  assert os.path.isdir(checkpoint)
  rows = read_records(os.path.join(config.workdir, "metrics.jsonl"))
  assert [r["step"] for r in rows if "event" not in r] == [0, 1, 2, 3]
  assert rows[-1] == {"event": "stop", "step": 4, "hook": "RaisesAt.on_step",
                      "error": "ValueError: bug at step 3",
                      "checkpoint": checkpoint}
  assert lines[-1] == ("stopped after 4 steps: hook RaisesAt.on_step raised at step 3: "
                       f"ValueError: bug at step 3; checkpoint written to {checkpoint}")
