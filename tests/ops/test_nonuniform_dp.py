"""DP replicas of different TP degree in one job: the cross-class sync is exact.

Parity of whole runs with a single device, proportional shares, slot weights, the other sync
plans and the optimizer state of every replica are in ``tests/plans/test_replica_plans.py``;
degrees up to 8 + 5 and three replicas in ``tests/system/test_mixed_degrees.py``."""

import numpy as np
import optax
import pytest
from helpers import assert_trees_close, run_job


@pytest.fixture(scope="module")
def dense_sgd_step():
  """One device's parameters before and after one SGD step at lr 1, no clipping."""
  sgd = optax.sgd(1.0)
  _, _, before, _ = run_job(tp=1, dp=1, steps=0, optimizer=sgd, clip_norm=0)
  _, _, after, _ = run_job(tp=1, dp=1, steps=1, optimizer=sgd, clip_norm=0)
  return before, after


def test_every_replica_has_identical_gradients_after_sync(dense_sgd_step):
  """4 + 3 syncs attention through the nested regroup (``sync.regroup_plan``); 4 + 2 (near-equal
  runs, no nesting) is in ``tests/plans/test_replica_plans.py``."""
  check_synced_gradients(dense_sgd_step, "1:2", [4, 3])


def check_synced_gradients(dense_sgd_step, failed, degrees):
  """With SGD at lr 1 and no clipping, params_before - params_after is the synced gradient:
  every replica's equals one device's."""
  before, dense_after = dense_sgd_step
  _, plan, after, _ = run_job(tp=4, dp=2, failed=failed, steps=1, optimizer=optax.sgd(1.0),
                              clip_norm=0)
  assert [r.degree for r in plan.replicas] == degrees
  dense_grad = _minus(before[0], dense_after[0])
  for replica_after in after:
    assert_trees_close(_minus(before[0], replica_after), dense_grad, rtol=1e-4, atol=1e-6)


def _minus(a, b):
  import jax
  return jax.tree.map(lambda x, y: x - y, a, b)


@pytest.mark.parametrize("failed", ["", "1:2"])
def test_steps_that_commit_train_as_the_plain_step(failed):
  """The committed step (gradients, sync, ``finish`` with each replica's own norm and loss,
  then ``apply_grads``) against the fused or split step, on a healthy plan (one class) and
  an uneven mixed-degree one, with a clip that binds: the same losses and parameters."""
  kwargs = dict(tp=4, dp=2, failed=failed, steps=3, clip_norm=0.05)
  losses, _, params, _ = run_job(**kwargs)
  committed, _, committed_params, _ = run_job(**kwargs, commit=True)
  np.testing.assert_allclose(committed, losses, rtol=1e-6)
  for a, b in zip(committed_params, params):
    assert_trees_close(a, b)
