"""Perf-per-power curve (ntp_jax.sim.power) and degree rule (ntp_jax.sim.degrees)."""

import numpy as np
import pytest

from ntp_jax.sim import DegreeRule, PowerCurve


def test_default_curve_matches_the_papers_efficiency_points():
  curve = PowerCurve()
  np.testing.assert_allclose(curve.efficiency([1.0, 1.1, 1.2]), [1.0, 0.972, 0.935], atol=1e-12)
  assert curve.max_speedup(0.3) == pytest.approx(1.3 * (1 - 0.235 * 0.3 - 0.45 * 0.09))


def test_speed_never_falls_as_power_rises():
  curve = PowerCurve()
  power = np.linspace(1.0, 2.5, 301)
  assert np.all(np.diff(curve.speed(power)) >= -1e-15)
  assert curve.speed(2.5) == pytest.approx(curve.speed(curve.peak_power))
  assert 1.3 < curve.peak_power < 1.5


def test_power_for_speedup_inverts_speed():
  curve = PowerCurve()
  wanted = np.array([0.5, 1.0, 1.05, 8 / 7, 1.15])
  power = curve.power_for_speedup(wanted, 0.3)
  np.testing.assert_allclose(curve.speed(power), np.maximum(wanted, 1.0), rtol=1e-12)
  assert curve.power_for_speedup(1.2, 0.3) == 1.3  # out of reach: the cap


def test_ideal_curve_is_linear():
  curve = PowerCurve(slope=0.0, curvature=0.0)
  assert curve.peak_power == float("inf")
  assert curve.speed(1.25) == 1.25
  assert curve.power_for_speedup(1.2, 0.3) == pytest.approx(1.2, abs=1e-12)


def test_curve_rejects_bad_input():
  with pytest.raises(ValueError):
    PowerCurve(slope=-1.0)
  with pytest.raises(ValueError):
    PowerCurve().speed(0.9)
  with pytest.raises(ValueError):
    PowerCurve().max_speedup(-0.1)


def test_degree_rule_tables():
  np.testing.assert_array_equal(DegreeRule().degree_table(4), [0, 1, 2, 3, 4])
  np.testing.assert_array_equal(DegreeRule((8, 6, 4)).degree_table(8),
                                [0, 0, 0, 0, 4, 4, 6, 6, 8])
  # The healthy degree is always allowed.
  np.testing.assert_array_equal(DegreeRule((2,)).degree_table(4), [0, 0, 2, 2, 4])


def test_batch_share_rounds_down_to_whole_samples():
  np.testing.assert_allclose(DegreeRule().batch_share([-0.5, 0.3, 1.7]), [0.0, 0.3, 1.0])
  np.testing.assert_allclose(DegreeRule(local_batch=8).batch_share([0.9375, 0.875, 1.2]),
                             [0.875, 0.875, 1.0])


def test_degree_rule_rejects_bad_input():
  with pytest.raises(ValueError):
    DegreeRule((0, 4))
  with pytest.raises(ValueError):
    DegreeRule(local_batch=0)
