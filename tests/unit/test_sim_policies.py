"""Hand-computed cases of the three policies (ntp_jax.sim.policies)."""

import numpy as np
import pytest

from ntp_jax.sim import DegreeRule, Policy, PolicySettings, PowerCurve, job_capacity
from ntp_jax.sim.policies import domain_degrees, replica_min_degrees, throughput_loss

DEFAULT = PolicySettings()
POLICIES = list(Policy)


def loss(counts, tp, pp, policy, settings=DEFAULT, target=None):
  return float(throughput_loss(np.array(counts), tp, pp, policy, settings, target))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("settings", [
    DEFAULT,
    PolicySettings(pack=False),
    PolicySettings(degree_rule=DegreeRule((32, 30, 28), local_batch=8)),
])
def test_no_failure_no_loss(policy, settings):
  assert loss(np.zeros(32, dtype=int), 32, 8, policy, settings) == 0.0


def test_one_failed_gpu_in_tp8_job_of_four_replicas():
  counts = [1, 0, 0, 0]  # 32 GPUs, TP8, one domain per replica
  assert loss(counts, 8, 1, Policy.DP_DROP) == 0.25
  assert loss(counts, 8, 1, Policy.NTP) == 1 / 32
  # 8/7 = 1.143x speed is within reach of +30 % power (1.1557x): no loss at all.
  assert loss(counts, 8, 1, Policy.NTP_PW) == 0.0


def test_boost_beyond_the_limit_recovers_what_it_can():
  counts = [2, 0, 0, 0]
  speed = PowerCurve().max_speedup(0.3)
  assert speed == pytest.approx(1.1557, abs=1e-12)
  assert loss(counts, 8, 1, Policy.NTP) == pytest.approx(0.25 / 4, abs=1e-15)
  assert loss(counts, 8, 1, Policy.NTP_PW) == pytest.approx((1 - 0.75 * speed) / 4, abs=1e-15)


def test_no_power_headroom_makes_ntp_pw_equal_ntp():
  counts = np.array([[3, 0, 1, 0], [0, 0, 0, 8]])
  flat = PolicySettings(power_limit=0.0)
  np.testing.assert_array_equal(throughput_loss(counts, 8, 1, Policy.NTP_PW, flat),
                                throughput_loss(counts, 8, 1, Policy.NTP, flat))


def test_ideal_power_curve_boosts_in_proportion():
  ideal = PolicySettings(power_curve=PowerCurve(slope=0.0, curvature=0.0))
  assert loss([1, 0, 0, 0], 8, 1, Policy.NTP_PW, ideal) == 0.0
  assert loss([2, 0, 0, 0], 8, 1, Policy.NTP_PW, ideal) == pytest.approx(
      (1 - 0.75 * 1.3) / 4, abs=1e-15)


def test_replica_runs_at_its_most_failed_stage():
  # TP8, two stages per replica, two replicas; stages fail 1 and 2 GPUs in one replica.
  assert loss([1, 2, 0, 0], 8, 2, Policy.NTP) == pytest.approx((2 / 8) / 2, abs=1e-15)
  np.testing.assert_array_equal(replica_min_degrees(np.array([1, 2, 0, 0]), 8, 2, DEFAULT),
                                [6, 8])


def test_packing_puts_failed_domains_in_few_replicas():
  spread = [1, 0, 1, 0]  # one failed GPU in each of the two replicas, as placed
  fixed = PolicySettings(pack=False)
  assert loss(spread, 8, 2, Policy.DP_DROP) == 0.5
  assert loss(spread, 8, 2, Policy.DP_DROP, fixed) == 1.0
  assert loss(spread, 8, 2, Policy.NTP) == 1 / 16
  assert loss(spread, 8, 2, Policy.NTP, fixed) == 1 / 8


def test_dp_drop_packs_partly_failed_domains():
  counts = np.zeros(16, dtype=int)
  counts[[0, 5, 10]] = [1, 3, 8]  # three hurt domains fit in one replica of four
  assert loss(counts, 8, 4, Policy.DP_DROP) == 0.25
  assert loss(counts, 8, 4, Policy.DP_DROP, PolicySettings(pack=False)) == 0.75


def test_fully_failed_domain_stops_its_replica_under_every_policy():
  for policy in POLICIES:
    assert loss([8, 0, 0, 0], 8, 1, policy) == 0.25


def test_discrete_degrees_and_whole_sample_batches():
  rule = PolicySettings(degree_rule=DegreeRule((32, 30, 28), local_batch=8))
  np.testing.assert_array_equal(domain_degrees(np.array([0, 1, 2, 3, 4, 5]), 32, rule),
                                [32, 30, 30, 28, 28, 0])
  counts = np.zeros(8, dtype=int)
  counts[0] = 1  # TP30 of 32: 7.5 samples of 8 fit, rounded down to 7
  assert loss(counts, 32, 1, Policy.NTP, rule) == 1 / 64
  counts[0] = 4  # TP28: 7 samples of 8
  assert loss(counts, 32, 1, Policy.NTP, rule) == 1 / 64
  counts[0] = 5  # below TP28: the replica stops
  assert loss(counts, 32, 1, Policy.NTP, rule) == 1 / 8
  assert loss(counts, 32, 1, Policy.NTP_PW, rule) == 1 / 8


def test_spare_domains_replace_failed_ones():
  counts = [1, 0, 0, 0, 0]  # four replicas of one domain plus one spare
  for policy in POLICIES:
    assert loss(counts, 8, 1, policy, target=4) == 0.0
  assert float(job_capacity(np.array(counts), 8, 1, Policy.NTP, DEFAULT)) == 4.875


def test_leftover_domains_idle_worst_first():
  # Five domains, two per replica: the fully failed one is left out.
  assert loss([8, 0, 0, 0, 0], 8, 2, Policy.DP_DROP, target=2) == 0.0
  assert loss([8, 0, 0, 0, 0], 8, 2, Policy.DP_DROP, PolicySettings(pack=False), target=2) == 0.5


def test_vectorised_over_leading_axes():
  counts = np.zeros((3, 5, 4), dtype=int)
  counts[1, 2, 0] = 1
  losses = throughput_loss(counts, 8, 1, Policy.NTP, DEFAULT)
  assert losses.shape == (3, 5)
  assert losses.sum() == 1 / 32


def test_rejects_bad_counts_and_settings():
  with pytest.raises(ValueError):
    loss([9, 0], 8, 1, Policy.NTP)
  with pytest.raises(ValueError):
    loss([-1, 0], 8, 1, Policy.NTP)
  with pytest.raises(ValueError):
    PolicySettings(power_limit=-0.1)
  with pytest.raises(ValueError):
    Policy("drop-everything")


def test_batch_policies_trade_tokens_per_step_for_step_time():
  from ntp_jax.sim.batch_policy import step_shape
  tokens, time = step_shape(np.array([4.0, 3.5, 0.0, 5.0]), 4, "proportional")
  np.testing.assert_allclose(tokens, [1.0, 0.875, 0.0, 1.0])
  np.testing.assert_allclose(time, 1.0)
  tokens, time = step_shape(np.array([4.0, 3.5, 0.0, 5.0]), 4, "constant")
  np.testing.assert_allclose(tokens, 1.0)
  np.testing.assert_allclose(time, [1.0, 4 / 3.5, np.inf, 1.0])
  with pytest.raises(ValueError, match="batch policy"):
    step_shape(1.0, 4, "equal")
