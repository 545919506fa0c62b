"""Per-replica decisions for the trainer (ntp_jax.sim.planner)."""

import pytest

from ntp_jax.sim import DegreeRule, PowerCurve, global_batch_fractions, plan_replicas


def test_one_failed_gpu_in_tp8_job_of_four_replicas():
  failed = {2: {5}}
  ntp = plan_replicas(failed, tp=8, pp=1, policy="ntp", num_domains=4)
  assert [(p.degree, p.batch_share, p.degraded) for p in ntp] == [
      (7, 0.875, True), (8, 1.0, False), (8, 1.0, False), (8, 1.0, False)]
  assert ntp[0].domains == (2,)  # packing puts the degraded replica first
  boosted = plan_replicas(failed, tp=8, pp=1, num_domains=4)
  assert boosted[0].batch_share == 1.0 and boosted[0].degree == 7
  assert 1.0 < boosted[0].boost <= 1.3
  assert PowerCurve().speed(boosted[0].boost) == pytest.approx(8 / 7, rel=1e-12)
  assert all(p.boost == 1.0 for p in boosted[1:])
  drop = plan_replicas(failed, tp=8, pp=1, policy="dp-drop", num_domains=4)
  assert [p.batch_share for p in drop] == [0.0, 1.0, 1.0, 1.0]
  assert drop[0].stage_degrees == (0,)


def test_input_forms_agree():
  as_sets = plan_replicas({1: {0, 3}, 6: {2}}, tp=8, pp=2, num_domains=8)
  as_counts = plan_replicas({1: 2, 6: 1}, tp=8, pp=2, num_domains=8)
  as_array = plan_replicas([0, 2, 0, 0, 0, 0, 1, 0], tp=8, pp=2)
  assert as_sets == as_counts == as_array


def test_stages_under_ntp_and_ntp_pw():
  failed = [0, 2, 0, 1, 0, 0, 0, 0]  # packed: domains 1 and 3 share replica 0
  ntp = plan_replicas(failed, tp=8, pp=2, policy="ntp")
  assert ntp[0].domains == (1, 3) and ntp[0].stage_degrees == (6, 6)
  assert ntp[0].batch_share == 0.75
  pw = plan_replicas(failed, tp=8, pp=2, power_limit=0.3)
  speed = PowerCurve().max_speedup(0.3)
  assert pw[0].stage_degrees == (6, 7)
  assert pw[0].batch_share == pytest.approx(0.75 * speed)
  assert pw[0].stage_boosts[0] == pytest.approx(1.3)
  assert pw[0].stage_boosts[1] == 1.0  # 7 GPUs keep pace with the reduced share unboosted


def test_fixed_placement_keeps_domains_in_place():
  plans = plan_replicas([0, 0, 1, 0], tp=8, pp=2, policy="ntp", pack=False)
  assert [p.domains for p in plans] == [(0, 1), (2, 3)]
  assert [p.degree for p in plans] == [8, 7]


def test_discrete_rule_in_the_plan():
  plans = plan_replicas({0: 1}, tp=32, pp=1, policy="ntp", num_domains=2,
                        degree_rule=DegreeRule((32, 30, 28), local_batch=8))
  assert (plans[0].degree, plans[0].batch_share) == (30, 0.875)


def test_global_batch_fractions():
  plans = plan_replicas({0: 1}, tp=8, pp=1, policy="ntp", num_domains=4)
  fractions = global_batch_fractions(plans)
  assert sum(fractions) == pytest.approx(1.0)
  assert fractions[0] == pytest.approx(0.875 / 3.875)
  with pytest.raises(ValueError):
    global_batch_fractions(plan_replicas([8], tp=8, pp=1, policy="ntp"))


def test_planner_rejects_malformed_failures():
  with pytest.raises(ValueError):
    plan_replicas({0: {1}}, tp=8, pp=1)  # no num_domains
  with pytest.raises(ValueError):
    plan_replicas({0: {8}}, tp=8, pp=1, num_domains=2)
  with pytest.raises(ValueError):
    plan_replicas({5: 1}, tp=8, pp=1, num_domains=2)
  with pytest.raises(ValueError):
    plan_replicas([0, 9], tp=8, pp=1)
