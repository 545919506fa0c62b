"""Failure placement, sweeps and timelines: invariants and seeds (ntp_jax.sim)."""

import dataclasses

import numpy as np
import pytest

from ntp_jax.sim import (
  ClusterSpec,
  FailureModel,
  PolicySettings,
  availability_timeline,
  failed_gpus_for_fraction,
  loss_sweep,
  sample_failed_counts,
  sample_timeline,
  spares_needed,
)

PAPER = ClusterSpec(num_gpus=32_768, tp=32, pp=8)
SMALL = ClusterSpec(num_gpus=4096, tp=32, pp=4)


def test_cluster_spec_shapes_and_errors():
  assert (PAPER.num_domains, PAPER.num_replicas, PAPER.units_per_domain) == (1024, 128, 32)
  with pytest.raises(ValueError):
    ClusterSpec(num_gpus=100, tp=32)
  with pytest.raises(ValueError):
    ClusterSpec(num_gpus=64, tp=32, blast_radius=3)


def test_placements_keep_the_failed_count():
  spec = ClusterSpec(num_gpus=4096, tp=32, pp=4, blast_radius=4)
  counts = sample_failed_counts(spec, 40, 50, np.random.default_rng(0), spare_domains=3)
  assert counts.shape == (50, 131)
  assert np.all(counts.sum(axis=1) == 40)
  assert np.all(counts % 4 == 0) and counts.max() <= 32
  assert failed_gpus_for_fraction(spec, 1e-2) == 40
  with pytest.raises(ValueError):
    sample_failed_counts(spec, 4097 + 4 * 32, 1, np.random.default_rng(0), spare_domains=3)


def test_one_failure_costs_dp_drop_one_replica_exactly():
  points = loss_sweep(SMALL, [1 / 4096], PolicySettings(), num_samples=20)
  by_policy = {p.policy: p for p in points}
  assert by_policy["dp-drop"].mean_loss == by_policy["dp-drop"].max_loss == 1 / 32
  assert by_policy["ntp"].max_loss == 1 / 32 / 32
  assert by_policy["ntp-pw"].max_loss == 0.0


def test_sweep_is_reproducible_by_seed():
  def run(seed):
    return loss_sweep(SMALL, [0.0, 2e-3, 5e-3], PolicySettings(), num_samples=300, seed=seed)
  assert run(3) == run(3)
  assert run(3) != run(4)
  assert all(p.mean_loss == 0.0 for p in run(3) if p.failed_gpus == 0)


def test_paper_setup_lands_near_the_papers_losses():
  points = loss_sweep(PAPER, [4e-3], PolicySettings(), num_samples=300, seed=1)
  by_policy = {p.policy: p for p in points}
  assert 0.11 < by_policy["dp-drop"].mean_loss < 0.14
  assert by_policy["ntp"].max_loss < 0.03
  assert by_policy["ntp-pw"].max_loss < 0.01


def test_tp64_availability_at_one_failure_in_a_thousand():
  spec = ClusterSpec(num_gpus=32_768, tp=64, pp=1)
  (point,) = loss_sweep(spec, [1e-3], PolicySettings(), ["dp-drop"], num_samples=300)
  assert 1 - point.mean_loss == pytest.approx(0.94, abs=0.01)


def test_blast_radius_at_fixed_failure_events_follows_figure_10():
  # Fig. 10 widens each failure: radius 4 at 4x the failed GPUs is the same number of events.
  by_radius = {}
  for radius in (1, 4):
    spec = ClusterSpec(num_gpus=32_768, tp=32, pp=8, blast_radius=radius)
    points = loss_sweep(spec, [radius * 4e-3], PolicySettings(), num_samples=300, seed=0)
    by_radius[radius] = {p.policy: p.mean_loss for p in points}
  assert by_radius[4]["dp-drop"] == pytest.approx(by_radius[1]["dp-drop"], abs=0.01)
  assert by_radius[4]["ntp"] > 3 * by_radius[1]["ntp"]
  assert by_radius[4]["ntp-pw"] >= by_radius[1]["ntp-pw"]
  assert by_radius[4]["ntp"] < by_radius[4]["dp-drop"] / 4


def test_failure_model_defaults_follow_the_paper():
  model = FailureModel()
  assert model.rate_per_gpu_hour == 419 / (16_384 * 54 * 24)  # Llama 3 report
  assert model.hardware_share == 0.78
  assert model.hardware_repair_hours == 5 * 24.0  # the paper's Fig. 7 (Fig. 4 also uses 3 days)
  assert model.software_repair_hours == 3.0


def test_failure_model_expectations_and_errors():
  model = FailureModel(rate_per_gpu_hour=1e-5, hardware_share=0.5, hardware_repair_hours=100.0,
                       software_repair_hours=2.0)
  assert model.mean_repair_hours == 51.0
  assert model.expected_failed_fraction(blast_radius=2) == pytest.approx(1e-5 * 2 * 51.0)
  with pytest.raises(ValueError):
    FailureModel(hardware_share=1.5)
  with pytest.raises(ValueError):
    FailureModel(repair_distribution="weibull")


@pytest.mark.parametrize("distribution", ["fixed", "exponential"])
def test_timeline_mean_matches_the_steady_state(distribution):
  model = FailureModel(repair_distribution=distribution)
  spec = ClusterSpec(num_gpus=65_536, tp=32, pp=8)
  timeline = sample_timeline(spec, model, 24.0 * 60, 2.0, np.random.default_rng(5))
  assert timeline.failed_counts.shape == (721, 2048)
  mean = timeline.failed_counts.sum(axis=1).mean() / spec.num_gpus
  assert mean == pytest.approx(model.expected_failed_fraction(), rel=0.15)


def test_timeline_without_failures_is_always_available():
  model = FailureModel(rate_per_gpu_hour=0.0)
  result = availability_timeline(SMALL, model, PolicySettings(), days=2, seed=0)
  assert result.failed_fraction.max() == 0.0
  assert all(np.all(v == 1.0) for v in result.availability.values())


def test_timeline_is_reproducible_and_policies_are_ordered():
  def run(seed):
    return availability_timeline(PAPER, FailureModel(), PolicySettings(), days=5, seed=seed)
  first, again = run(7), run(7)
  for name in first.availability:
    np.testing.assert_array_equal(first.availability[name], again.availability[name])
  drop, ntp, boosted = (first.availability[n] for n in ("dp-drop", "ntp", "ntp-pw"))
  assert np.all(drop <= ntp) and np.all(ntp <= boosted)
  assert 0.0 <= first.fraction_of_time_above(1e-3) <= 1.0


def test_spares_order_the_policies():
  result = spares_needed(SMALL, FailureModel(), PolicySettings(), max_spares=40, days=5, seed=2)
  needed = result.needed
  assert needed["ntp-pw"] <= needed["ntp"] <= needed["dp-drop"]
  for name, running in result.running_fraction.items():
    assert np.all(np.diff(running) >= 0), name  # more spares never hurt
  assert result.per_gpu_throughput["ntp-pw"][0] == 1.0


def test_spares_ignore_the_packing_setting():
  fixed = dataclasses.replace(PolicySettings(), pack=False)
  a = spares_needed(SMALL, FailureModel(), fixed, max_spares=16, days=3, seed=0)
  b = spares_needed(SMALL, FailureModel(), PolicySettings(), max_spares=16, days=3, seed=0)
  assert a.needed == b.needed


def test_a_point_does_not_depend_on_the_rest_of_the_sweep():
  alone = loss_sweep(SMALL, [4e-3], PolicySettings(), num_samples=200, seed=9)
  within = loss_sweep(SMALL, [1e-3, 4e-3], PolicySettings(), num_samples=200, seed=9)
  assert alone == within[3:]
