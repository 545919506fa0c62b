"""Performance of a power-boosted GPU: a perf-per-power curve with diminishing returns."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

_BISECTION_STEPS = 60


@dataclasses.dataclass(frozen=True)
class PowerCurve:
  """Relative GPU speed as a function of relative power, at or above TDP.

  Power ``p`` is a multiple of TDP (1.0 = TDP, 1.3 = +30 %). Energy
  efficiency (speed per watt, relative to TDP) falls as power rises::

    efficiency(p) = 1 - slope * (p - 1) - curvature * (p - 1) ** 2
    speed(p) = p * efficiency(p)

  The defaults pass through the two points the paper reports for its TP30
  configuration (Arfeen et al., Table 1 and its sensitivity discussion): speed per watt
  2.8 % lower at 1.1x TDP and 6.5 % lower at 1.2x TDP, so speed is 1.069x and
  1.122x, and about 1.156x at the default +30 % limit. Past the peak of
  ``speed`` (about 1.40x TDP with the defaults) more power buys nothing, so
  speed is held at its peak. ``slope = curvature = 0`` gives an ideal curve
  where speed is proportional to power.

  Attributes:
    slope: Linear loss of efficiency per unit of extra relative power.
    curvature: Quadratic loss of efficiency per unit of extra relative power.

  Raises:
    ValueError: If ``slope`` or ``curvature`` is negative.
  """

  slope: float = 0.235
  curvature: float = 0.45

  def __post_init__(self):
    if self.slope < 0 or self.curvature < 0:
      raise ValueError(f"slope and curvature must be >= 0, got {self.slope}, {self.curvature}")

  @property
  def peak_power(self) -> float:
    """Relative power where speed stops rising (``inf`` for the ideal curve)."""
    a, b = self.slope, self.curvature
    # d/dp [p - a p (p - 1) - b p (p - 1)^2] = 0  <=>  3b p^2 + (2a - 4b) p - (1 + a - b) = 0.
    if b > 0:
      lin = 2 * a - 4 * b
      return (-lin + math.sqrt(lin * lin + 12 * b * (1 + a - b))) / (6 * b)
    if a > 0:
      return (1 + a) / (2 * a)
    return math.inf

  def efficiency(self, power):
    """Speed per watt relative to TDP.

    Args:
      power: Relative power, scalar or array, each >= 1.

    Returns:
      Array (or float) of the same shape.

    Raises:
      ValueError: If any power is below 1 (under-TDP operation is not modelled).
    """
    p = np.asarray(power, dtype=np.float64)
    if np.any(p < 1.0):
      raise ValueError("power must be >= 1 (a multiple of TDP)")
    extra = np.minimum(p, self.peak_power) - 1.0
    return 1.0 - self.slope * extra - self.curvature * extra * extra

  def speed(self, power):
    """Relative speed at ``power`` (1.0 at TDP), non-decreasing in power.

    Args:
      power: Relative power, scalar or array, each >= 1.

    Returns:
      Array (or float) of the same shape.
    """
    p = np.minimum(np.asarray(power, dtype=np.float64), self.peak_power)
    return p * self.efficiency(p)

  def max_speedup(self, power_limit: float) -> float:
    """Speed reachable within ``power_limit`` extra power (0.3 = +30 % of TDP)."""
    if power_limit < 0:
      raise ValueError(f"power_limit must be >= 0, got {power_limit}")
    return float(self.speed(1.0 + power_limit))

  def power_for_speedup(self, speedup, power_limit: float):
    """Least relative power reaching ``speedup``, capped at ``1 + power_limit``.

    Args:
      speedup: Wanted relative speed, scalar or array; values <= 1 need TDP.
      power_limit: Extra power allowed, as a fraction of TDP.

    Returns:
      Array (or float) of relative powers in ``[1, 1 + power_limit]``. Where
      the speedup is out of reach the cap is returned; compare with
      ``max_speedup`` to tell.
    """
    target = np.asarray(speedup, dtype=np.float64)
    top = min(1.0 + power_limit, self.peak_power)
    lo = np.ones_like(target)
    hi = np.full_like(target, top)
    for _ in range(_BISECTION_STEPS):
      mid = 0.5 * (lo + hi)
      reached = self.speed(mid) >= target
      hi = np.where(reached, mid, hi)
      lo = np.where(reached, lo, mid)
    power = np.where(target <= 1.0, 1.0, hi)
    power = np.where(self.speed(top) >= target, power, 1.0 + power_limit)
    return power if power.ndim else float(power)
