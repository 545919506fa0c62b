"""Availability of the job over a sampled failure timeline (Arfeen et al., Figures 3, 4)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ntp_jax.sim.cluster import ClusterSpec
from ntp_jax.sim.failures import FailureModel, sample_timeline
from ntp_jax.sim.policies import ALL_POLICIES, Policy, PolicySettings, throughput_loss


@dataclasses.dataclass(frozen=True)
class AvailabilityTimeline:
  """Failed fraction and per-policy availability at each step.

  Availability is ``1 - throughput loss``: the job's throughput relative to
  its healthy throughput. Under DP-DROP with one domain per replica it is the
  fraction of GPUs in domains with no failed GPU, the quantity of the paper's
  Figure 3.

  Attributes:
    hours: Float array ``[num_steps]``.
    failed_fraction: Float array ``[num_steps]``, failed GPUs over the job's
      GPUs (spares' failures included in the numerator).
    availability: Policy name to float array ``[num_steps]``.
  """

  hours: np.ndarray
  failed_fraction: np.ndarray
  availability: dict[str, np.ndarray]

  def fraction_of_time_above(self, failed_fraction: float) -> float:
    """Share of steps with more than ``failed_fraction`` of GPUs failed."""
    return float(np.mean(self.failed_fraction > failed_fraction))

  def summary(self) -> list[dict]:
    """One row per policy: mean and minimum availability."""
    return [{"policy": name, "mean_availability": float(values.mean()),
             "min_availability": float(values.min())}
            for name, values in self.availability.items()]


def availability_timeline(spec: ClusterSpec, model: FailureModel, settings: PolicySettings,
                          days: float = 15.0, step_hours: float = 1.0, seed: int = 0,
                          policies: Sequence[Policy] = ALL_POLICIES,
                          spare_domains: int = 0) -> AvailabilityTimeline:
  """Samples one failure timeline and evaluates every policy on it.

  Args:
    spec: The cluster.
    model: Failure and repair process.
    settings: Policy settings.
    days: Length of the window (the paper traces 15 days).
    step_hours: Grid spacing.
    seed: Seed of the timeline.
    policies: Policies to evaluate on the same timeline.
    spare_domains: Spare domains that may replace failed ones.

  Returns:
    The availability timeline.
  """
  rng = np.random.default_rng(seed)
  timeline = sample_timeline(spec, model, days * 24.0, step_hours, rng, spare_domains)
  availability = {}
  for policy in policies:
    policy = Policy(policy)
    loss = throughput_loss(timeline.failed_counts, spec.tp, spec.pp, policy, settings,
                           spec.num_replicas)
    availability[policy.value] = 1.0 - loss
  failed = timeline.failed_counts.sum(axis=-1) / spec.num_gpus
  return AvailabilityTimeline(hours=timeline.hours, failed_fraction=failed,
                              availability=availability)
