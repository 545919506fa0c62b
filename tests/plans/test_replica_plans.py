"""Whole runs of DP replicas of different TP degree against a single device: 10 steps healthy
and with a failed slot, proportional shares, slot weights, the near-equal-runs sync plan
(``tests/ops/test_nonuniform_dp.py`` checks the nested one), identical AdamW moments."""

import numpy as np
import optax
import pytest
from helpers import assert_trees_close, run_job
from ops.test_nonuniform_dp import check_synced_gradients, dense_sgd_step  # noqa: F401


def test_every_replica_has_identical_gradients_after_sync_on_near_equal_runs(
    dense_sgd_step):  # noqa: F811  (the fixture of tests/ops)
  check_synced_gradients(dense_sgd_step, "1:0,1:3", [4, 2])


@pytest.fixture(scope="module")
def single_device():
  return run_job(tp=1, dp=1, steps=10)


@pytest.mark.parametrize("failed", ["", "1:2"], ids=["healthy", "replica1-slot2-failed"])
def test_2x4_matches_single_device_for_10_steps(single_device, failed):
  losses, plan, params, _ = run_job(tp=4, dp=2, failed=failed, steps=10)
  assert len(plan.classes) == (2 if failed else 1)
  np.testing.assert_allclose(losses, single_device[0], rtol=2e-5)
  for replica_params in params:  # every replica's copy equals the single-device result
    assert_trees_close(replica_params, single_device[2][0], rtol=1e-5, atol=1e-6)


def test_proportional_shares_keep_global_batch_in_proportion_to_live_devices():
  losses, plan, params, _ = run_job(tp=4, dp=2, failed="1:2", rebalance="proportional",
                                    batch_size=8, steps=2)
  assert [r.batch_share for r in plan.replicas] == [4, 3]
  single, _, single_params, _ = run_job(tp=1, dp=1, batch_size=7, steps=2)
  np.testing.assert_allclose(losses, single, rtol=2e-5)
  assert_trees_close(params[1], single_params[0], rtol=1e-5, atol=1e-6)


def test_slot_weights_give_slow_slot_fewer_units_and_same_result(single_device):
  losses, plan, _, programs = run_job(tp=4, dp=2, failed="1:1", slot_weights="1,1,1,0.25",
                                      steps=3)
  ffn = plan.classes[0].layouts.ffn  # 5 units of 4 columns on weights 1,1,1,0.25
  assert ffn.units == (2, 1, 1, 1) or ffn.units[-1] <= min(ffn.units[:-1])
  heads = plan.classes[1].layouts.heads  # slots 0,2,3 with weights 1,1,0.25
  assert heads.units[-1] < heads.units[0]
  np.testing.assert_allclose(losses, single_device[0][:3], rtol=2e-5)


def test_every_replica_keeps_identical_optimizer_state():
  """AdamW moments of every replica (healthy and reduced) agree in logical form."""
  import jax

  from ntp_jax.layers.shard import replica_view, to_logical
  adamw = optax.adamw(1e-2, b2=0.95, weight_decay=0.1)
  _, _, _, programs = run_job(tp=4, dp=2, failed="1:2", steps=3, optimizer=adamw)
  moments = []
  for program in programs:
    adam_state = program.opt_state[0]  # ScaleByAdamState(count, mu, nu)
    for r in range(program.replicas):
      moments.append((int(adam_state.count),
                      jax.tree.map(np.asarray, to_logical(replica_view(adam_state.mu, r))),
                      jax.tree.map(np.asarray, to_logical(replica_view(adam_state.nu, r)))))
  count, mu, nu = moments[0]
  assert count == 3
  for other_count, other_mu, other_nu in moments[1:]:
    assert other_count == count
    assert_trees_close(other_mu, mu, rtol=1e-5, atol=1e-7)
    assert_trees_close(other_nu, nu, rtol=1e-4, atol=1e-10)
