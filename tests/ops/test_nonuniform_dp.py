"""DP replicas of different TP degree in one job: parity with a single device, exact sync."""

import json
import os
import subprocess
import sys

import numpy as np
import optax
import pytest
from helpers import ROOT, assert_trees_close, run_job


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


@pytest.fixture(scope="module")
def dense_sgd_step():
  """One device's parameters before and after one SGD step at lr 1, no clipping."""
  sgd = optax.sgd(1.0)
  _, _, before, _ = run_job(tp=1, dp=1, steps=0, optimizer=sgd, clip_norm=0)
  _, _, after, _ = run_job(tp=1, dp=1, steps=1, optimizer=sgd, clip_norm=0)
  return before, after


@pytest.mark.parametrize("failed,degrees", [("1:0,1:3", [4, 2]), ("1:2", [4, 3])],
                         ids=["near-equal-runs", "nested-attention"])
def test_every_replica_has_identical_gradients_after_sync(dense_sgd_step, failed, degrees):
  # With SGD at lr 1 and no clipping, params_before - params_after is the synced gradient.
  # 4 + 3 syncs attention through the nested regroup (sync.regroup_plan), 4 + 2 does not.
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


MIXED = [  # (tp, dp, failed slots, TP degrees of the replicas)
    (4, 3, "1:3,2:2,2:3", [4, 3, 2]),
    (8, 2, "1:3", [8, 7]),
    (8, 2, "1:1,1:2,1:4", [8, 5]),
    (8, 3, "1:5,2:0,2:7", [8, 7, 6]),
]


def test_mixed_degrees_match_single_device_in_subprocess():
  """Needs up to 24 devices: one subprocess of its own device count runs every plan of
  ``MIXED`` (one start-up, and one single-device reference per batch size).

  Plain SGD here: the parameters are compared to 2e-6 absolute.
  """
  code = f"""
import json, sys
import jax, numpy as np, optax
sys.path.insert(0, "tests")  # the repository root is the working directory
from helpers import run_job
sgd, refs = optax.sgd(0.5), {{}}
for tp, dp, failed in {[(tp, dp, failed) for tp, dp, failed, _ in MIXED]!r}:
  if dp not in refs:
    refs[dp] = run_job(tp=1, dp=1, steps=10, batch_size=2 * dp, optimizer=sgd)
  ref = refs[dp]
  out = run_job(tp=tp, dp=dp, failed=failed, steps=10, batch_size=2 * dp, optimizer=sgd)
  diff = max(float(np.max(np.abs(a - b))) for p in out[2]
             for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref[2][0])))
  print(json.dumps(dict(ref=ref[0], out=out[0], diff=diff,
                        degrees=[r.degree for r in out[1].replicas])), flush=True)
"""
  devices = max(tp * dp for tp, dp, _, _ in MIXED)
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  reports = [json.loads(line) for line in result.stdout.strip().splitlines()[-len(MIXED):]]
  for (tp, dp, failed, degrees), report in zip(MIXED, reports):
    assert report["degrees"] == degrees, (tp, dp, failed)
    np.testing.assert_allclose(report["out"], report["ref"], rtol=2e-5)
    assert report["diff"] < 2e-6, (tp, dp, failed, report)


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
