"""Failure and repair process over time (Arfeen et al., Figures 4 and 7).

Defaults follow the paper's failure simulation. Its rate comes from the Llama 3
training report (read here as 419 unexpected interruptions in 54 days on
16,384 H100 GPUs, about 1.97e-5 failures per GPU-hour), of which 78 % are
hardware failures; the paper repairs those in 3 or 5 days (Figure 4 uses both,
Figure 7 uses 5, the default here) and the other 22 %, software failures, in
3 hours.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ntp_jax.sim.cluster import ClusterSpec

LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (16_384 * 54 * 24)
_REPAIR_DISTRIBUTIONS = ("fixed", "exponential")
_EXPONENTIAL_WARMUP = 10.0  # warm-up in mean repair times; leaves e**-10 of the start transient


@dataclasses.dataclass(frozen=True)
class FailureModel:
  """Poisson failures per GPU, each either hardware or software, then a repair.

  Every GPU fails at ``rate_per_gpu_hour``; a failure takes out its whole
  failure unit (``ClusterSpec.blast_radius`` GPUs) until repaired. A unit that
  fails again while down stays down until its last repair ends.

  Attributes:
    rate_per_gpu_hour: Failures per GPU per hour.
    hardware_share: Fraction of failures that are hardware failures.
    hardware_repair_hours: Repair time of a hardware failure (its mean when
      repairs are exponential).
    software_repair_hours: Repair time of a software failure (likewise).
    repair_distribution: ``"fixed"`` durations or ``"exponential"`` ones.

  Raises:
    ValueError: On a negative rate or time, a share outside ``[0, 1]`` or an
      unknown distribution.
  """

  rate_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
  hardware_share: float = 0.78
  hardware_repair_hours: float = 5 * 24.0
  software_repair_hours: float = 3.0
  repair_distribution: str = "fixed"

  def __post_init__(self):
    if self.rate_per_gpu_hour < 0:
      raise ValueError(f"rate_per_gpu_hour must be >= 0, got {self.rate_per_gpu_hour}")
    if not 0.0 <= self.hardware_share <= 1.0:
      raise ValueError(f"hardware_share must lie in [0, 1], got {self.hardware_share}")
    if self.hardware_repair_hours < 0 or self.software_repair_hours < 0:
      raise ValueError("repair times must be >= 0")
    if self.repair_distribution not in _REPAIR_DISTRIBUTIONS:
      raise ValueError(f"repair_distribution must be one of {_REPAIR_DISTRIBUTIONS}, "
                       f"got {self.repair_distribution!r}")

  @property
  def mean_repair_hours(self) -> float:
    """Mean time a failure keeps its unit down."""
    return (self.hardware_share * self.hardware_repair_hours
            + (1.0 - self.hardware_share) * self.software_repair_hours)

  def expected_failed_fraction(self, blast_radius: int = 1) -> float:
    """Long-run fraction of GPUs down, ignoring overlapping failures of one unit."""
    return self.rate_per_gpu_hour * blast_radius * self.mean_repair_hours

  def warmup_hours(self) -> float:
    """Simulated time before the window so that it starts in steady state."""
    longest = max(self.hardware_repair_hours, self.software_repair_hours)
    if self.repair_distribution == "exponential":
      return _EXPONENTIAL_WARMUP * longest
    return longest


@dataclasses.dataclass(frozen=True)
class Timeline:
  """Failed GPUs per domain on a time grid.

  Attributes:
    hours: Float array ``[num_steps]``, sample times in hours from the start.
    failed_counts: Int array ``[num_steps, num_domains]`` of failed GPUs.
  """

  hours: np.ndarray
  failed_counts: np.ndarray


def sample_timeline(spec: ClusterSpec, model: FailureModel, hours: float, step_hours: float,
                    rng: np.random.Generator, spare_domains: int = 0) -> Timeline:
  """Samples failures and repairs and reads the failed GPUs at each step.

  Events are drawn all at once (count, times, units, kinds, repair times) and
  their down intervals are rasterised onto the grid, so the cost grows with
  the number of events times their length in steps, not with the GPU count.

  Args:
    spec: The cluster.
    model: Failure and repair process.
    hours: Length of the window.
    step_hours: Grid spacing; states are read at ``0, step, 2 step, ...``.
    rng: Random generator (its state advances).
    spare_domains: Extra domains that fail like the others (appended last).

  Returns:
    The timeline.

  Raises:
    ValueError: If ``hours`` or ``step_hours`` is not positive.
  """
  if hours <= 0 or step_hours <= 0:
    raise ValueError(f"hours and step_hours must be > 0, got {hours}, {step_hours}")
  num_domains = spec.num_domains + spare_domains
  num_units = num_domains * spec.units_per_domain
  num_steps = int(np.floor(hours / step_hours + 1e-9)) + 1
  warmup = model.warmup_hours()
  unit_rate = model.rate_per_gpu_hour * spec.blast_radius
  num_events = rng.poisson(unit_rate * num_units * (hours + warmup))
  start = rng.uniform(-warmup, hours, num_events)
  unit = rng.integers(0, num_units, num_events)
  hardware = rng.random(num_events) < model.hardware_share
  repair = np.where(hardware, model.hardware_repair_hours, model.software_repair_hours)
  if model.repair_distribution == "exponential":
    repair = rng.exponential(1.0, num_events) * repair
  # Grid steps i with start <= i * step < start + repair.
  first = np.clip(np.ceil(start / step_hours - 1e-9), 0, num_steps).astype(np.int64)
  stop = np.clip(np.ceil((start + repair) / step_hours - 1e-9), 0, num_steps).astype(np.int64)
  length = np.maximum(stop - first, 0)
  event_of = np.repeat(np.arange(num_events), length)
  offset = np.arange(length.sum()) - np.repeat(np.cumsum(length) - length, length)
  step = first[event_of] + offset
  down = np.unique(step * num_units + unit[event_of])  # a unit counts once per step
  domain_key = (down // num_units) * num_domains + (down % num_units) // spec.units_per_domain
  counts = np.bincount(domain_key, minlength=num_steps * num_domains)
  failed = counts.reshape(num_steps, num_domains) * spec.blast_radius
  return Timeline(hours=np.arange(num_steps) * step_hours, failed_counts=failed)
