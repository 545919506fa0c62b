"""Training runs with micro-batches, and with a global batch that failures leave unchanged."""

import numpy as np
import pytest
from helpers import micro_config

from ntp_jax.errors import ConfigError
from ntp_jax.training.trainer import train

QUIET = dict(log=lambda *_: None)


def run(workdir, **overrides):
  return train(micro_config(workdir, **overrides), **QUIET)


def per_step(result):
  """(loss, tokens, data_cursor) of every step."""
  return ([r["loss"] for r in result.records], [r["tokens"] for r in result.records],
          [r["data_cursor"] for r in result.records])


def test_four_micro_batches_train_as_one_pass(tmp_path):
  """gpt_micro, 6 steps at TP degree 7: train.microbatches=4 against 1, at the same global
  batch. (Mixed degrees, parameters compared: tests/plans/test_accumulate_plans.py.)"""
  steps = {"train.steps": 6, "mesh.tp": 8, "ntp.failed": "3"}
  one = run(tmp_path / "one", **steps)
  four = run(tmp_path / "four", **steps, **{"train.microbatches": 4})
  healthy = four.plan.classes[0]
  assert healthy.microbatches == 4 or len(four.plan.classes) > 1
  assert [c.microbatches for c in four.plan.classes] == [
      -(-c.batch_share // (16 // len(four.plan.replicas) // 4)) for c in four.plan.classes]
  np.testing.assert_allclose(four.losses, one.losses, rtol=1e-5)


def test_constant_batch_through_a_failure_and_a_repair(tmp_path):
  """dp=2 tp=4: replica 1 at degree 3 for steps 4-7 takes 7 of the 16 sequences."""
  mesh = {"mesh.dp": 2, "mesh.tp": 4, "ntp.rebalance": "constant", "train.steps": 12}
  healthy = run(tmp_path / "healthy", **mesh)
  failed = run(tmp_path / "failed", **mesh,
               **{"ntp.fail_at": "4@1:2", "ntp.repair_at": "8@1:2"})
  degrees = [r["tp_degrees"] for r in failed.records]
  assert degrees == [[4, 4]] * 4 + [[4, 3]] * 4 + [[4, 4]] * 4
  want, got = per_step(healthy), per_step(failed)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert got[1:] == want[1:]
  assert got[2] == [16 * (i + 1) for i in range(12)]


def test_constant_batch_through_a_dropped_replica(tmp_path):
  """dp=3: replica 2 loses every slot at step 4; the other two absorb its share."""
  mesh = {"mesh.dp": 3, "mesh.tp": 2, "train.batch_size": 12, "ntp.rebalance": "constant",
          "train.steps": 8}
  healthy = run(tmp_path / "healthy", **mesh)
  dropped = run(tmp_path / "dropped", **mesh, **{"ntp.fail_at": "4@2:0,4@2:1"})
  assert [r.replica for r in dropped.plan.replicas] == [0, 1]
  assert [r.batch_share for r in dropped.plan.replicas] == [6, 6]
  want, got = per_step(healthy), per_step(dropped)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert got[1:] == want[1:]


def test_micro_batches_that_do_not_divide_a_share_are_a_config_error(tmp_path):
  with pytest.raises(ConfigError, match="train.microbatches"):
    run(tmp_path, **{"mesh.dp": 2, "mesh.tp": 4, "train.microbatches": 3})
