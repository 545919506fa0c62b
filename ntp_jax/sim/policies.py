"""The three failure policies, vectorised over sampled failures (Arfeen et al., Figure 6).

Every function takes ``failed_counts``, an int array of shape
``[..., num_domains]`` holding failed GPUs per scale-up domain; leading axes
are samples or time steps. Domains are grouped into replicas of ``pp``
stages. With packing (the default, as in the paper's resource manager) the job
chooses which domains form a replica, so the most-failed domains are put
together and the number of hurt replicas is as small as possible; without it,
domain ``d`` belongs to replica ``d // pp``. Domains left over when the count
is not a multiple of ``pp`` (only with spares) stay idle, the worst ones first.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from ntp_jax.sim.degrees import DegreeRule
from ntp_jax.sim.power import PowerCurve


class Policy(str, enum.Enum):
  """How a job treats a replica that holds failed GPUs."""

  DP_DROP = "dp-drop"
  NTP = "ntp"
  NTP_PW = "ntp-pw"


ALL_POLICIES = (Policy.DP_DROP, Policy.NTP, Policy.NTP_PW)


@dataclasses.dataclass(frozen=True)
class PolicySettings:
  """Knobs shared by the policies.

  Attributes:
    power_limit: Extra power a boosted GPU may draw, as a fraction of TDP
      (NTP-PW only; the paper's rack design allows +30 %).
    power_curve: Speed of a GPU against its power.
    degree_rule: Allowed reduced degrees and batch granularity.
    pack: Whether partly failed domains are packed into as few replicas as
      possible (the paper's resource manager) rather than kept in a fixed placement.
  """

  power_limit: float = 0.3
  power_curve: PowerCurve = PowerCurve()
  degree_rule: DegreeRule = DegreeRule()
  pack: bool = True

  def __post_init__(self):
    if self.power_limit < 0:
      raise ValueError(f"power_limit must be >= 0, got {self.power_limit}")

  @property
  def max_speedup(self) -> float:
    """Speed a boosted GPU reaches at the power limit."""
    return self.power_curve.max_speedup(self.power_limit)


def domain_degrees(failed_counts, tp: int, settings: PolicySettings) -> np.ndarray:
  """TP degree each domain runs at.

  Args:
    failed_counts: Int array ``[..., num_domains]`` of failed GPUs per domain.
    tp: Domain size.
    settings: Policy settings (their degree rule is used).

  Returns:
    Int array of the same shape.

  Raises:
    ValueError: If a count is negative or above ``tp``.
  """
  failed = np.asarray(failed_counts)
  if failed.size and (failed.min() < 0 or failed.max() > tp):
    raise ValueError(f"failed counts must lie in [0, {tp}]")
  return settings.degree_rule.degree_table(tp)[tp - failed]


def group_domains(num_domains: int, degrees, pp: int, pack: bool) -> np.ndarray:
  """Order of domains such that consecutive runs of ``pp`` form the replicas.

  Args:
    num_domains: Domains available (the last axis of ``degrees``).
    degrees: Int array ``[..., num_domains]`` of domain degrees.
    pp: Domains per replica.
    pack: Sort by degree, worst first, so failed domains share replicas.

  Returns:
    Int array ``[..., (num_domains // pp) * pp]`` of domain indices; the
    leftover domains (the worst, when packing) are left out.
  """
  degrees = np.asarray(degrees)
  used = (num_domains // pp) * pp
  if pack:
    order = np.argsort(degrees, axis=-1, kind="stable")
    return order[..., num_domains - used:]
  return np.broadcast_to(np.arange(used), degrees.shape[:-1] + (used,))


def replica_min_degrees(failed_counts, tp: int, pp: int, settings: PolicySettings) -> np.ndarray:
  """Degree of each replica's most-failed stage.

  Args:
    failed_counts: Int array ``[..., num_domains]``.
    tp: Domain size.
    pp: Domains per replica.
    settings: Policy settings.

  Returns:
    Int array ``[..., num_domains // pp]``.
  """
  degrees = domain_degrees(failed_counts, tp, settings)
  num_domains = degrees.shape[-1]
  used = (num_domains // pp) * pp
  if settings.pack:
    # Sorted ascending with the worst leftovers dropped: each run's first entry is its minimum.
    ordered = np.sort(degrees, axis=-1)[..., num_domains - used:]
    return ordered[..., ::pp]
  grouped = degrees[..., :used].reshape(degrees.shape[:-1] + (used // pp, pp))
  return grouped.min(axis=-1)


def replica_shares(min_degrees, tp: int, policy: Policy, settings: PolicySettings) -> np.ndarray:
  """Fraction of a healthy replica's samples each replica contributes per step.

  DP-DROP keeps only whole replicas. NTP runs a replica at the degree of its
  most-failed stage, so its speed is ``t / T``. NTP-PW boosts the reduced
  domains, multiplying that speed by up to the curve's speed at the power
  limit, and never above a healthy replica's (the step barrier).

  Args:
    min_degrees: Int array of replica bottleneck degrees, any shape.
    tp: Healthy degree ``T``.
    policy: The policy.
    settings: Policy settings.

  Returns:
    Float array of the same shape, in ``[0, 1]``.
  """
  degrees = np.asarray(min_degrees)
  policy = Policy(policy)
  if policy is Policy.DP_DROP:
    return (degrees >= tp).astype(np.float64)
  speed = degrees / tp
  if policy is Policy.NTP_PW:
    speed = speed * settings.max_speedup
  return settings.degree_rule.batch_share(speed)


def job_capacity(failed_counts, tp: int, pp: int, policy: Policy,
                 settings: PolicySettings) -> np.ndarray:
  """Samples the job processes per step, in healthy local batches.

  Args:
    failed_counts: Int array ``[..., num_domains]`` (spare domains included).
    tp: Domain size.
    pp: Domains per replica.
    policy: The policy.
    settings: Policy settings.

  Returns:
    Float array ``[...]``: the sum of replica shares.
  """
  mins = replica_min_degrees(failed_counts, tp, pp, settings)
  return replica_shares(mins, tp, policy, settings).sum(axis=-1)


def throughput_loss(failed_counts, tp: int, pp: int, policy: Policy, settings: PolicySettings,
                    target_replicas: int | None = None) -> np.ndarray:
  """``1 - throughput / healthy throughput`` for each failure configuration.

  The job needs ``target_replicas`` healthy local batches per step (default:
  as many replicas as the domains form). Spare capacity above the target
  earns nothing, so the loss is never negative.

  Args:
    failed_counts: Int array ``[..., num_domains]``.
    tp: Domain size.
    pp: Domains per replica.
    policy: The policy.
    settings: Policy settings.
    target_replicas: Replicas the healthy job runs.

  Returns:
    Float array ``[...]`` in ``[0, 1]``.
  """
  failed = np.asarray(failed_counts)
  target = failed.shape[-1] // pp if target_replicas is None else target_replicas
  capacity = job_capacity(failed, tp, pp, policy, settings)
  return 1.0 - np.minimum(capacity, target) / target
