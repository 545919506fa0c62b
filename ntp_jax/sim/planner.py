"""Per-replica decisions for a trainer: degrees, batch shares and boost levels.

Given which GPUs are down, says which replicas degrade, the TP degree each of
their stages runs at, the share of a healthy local batch each replica takes,
and the power each stage's GPUs run at (Arfeen et al., design: NTP, dynamic power
allocation and the resource manager).
Plain Python and numpy, independent of JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from ntp_jax.sim.degrees import DegreeRule
from ntp_jax.sim.policies import (
  Policy,
  PolicySettings,
  domain_degrees,
  group_domains,
  replica_shares,
)
from ntp_jax.sim.power import PowerCurve


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
  """What one DP replica does until the next failure or repair.

  Attributes:
    replica: Replica index; with packing, degraded replicas come first.
    domains: Domain indices of the replica, stage 0 first.
    stage_degrees: TP degree of each stage; all zeros if the replica stops.
      Under NTP every stage runs at the bottleneck degree; under NTP-PW each
      stage keeps its own degree and the reduced ones are boosted.
    stage_boosts: Relative power (1.0 = TDP) of each stage's GPUs.
    degree: Bottleneck degree (the smallest stage degree); 0 if stopped.
    batch_share: Fraction of a healthy replica's local batch, in ``[0, 1]``.
    boost: Largest stage boost.
    degraded: Whether the replica runs short of a healthy one (smaller
      degree or smaller share).
  """

  replica: int
  domains: tuple[int, ...]
  stage_degrees: tuple[int, ...]
  stage_boosts: tuple[float, ...]
  degree: int
  batch_share: float
  boost: float
  degraded: bool


def _failed_counts(failed, tp: int, num_domains: int | None) -> np.ndarray:
  """Failed GPUs per domain from any accepted form of ``failed``."""
  if isinstance(failed, Mapping):
    if num_domains is None:
      raise ValueError("num_domains is required when failed is a mapping")
    counts = np.zeros(num_domains, dtype=np.int64)
    for domain, gpus in failed.items():
      if not 0 <= domain < num_domains:
        raise ValueError(f"domain {domain} is outside [0, {num_domains})")
      if isinstance(gpus, Collection):
        local = set(gpus)
        if any(not 0 <= g < tp for g in local):
          raise ValueError(f"domain {domain}: GPU indices must lie in [0, {tp})")
        counts[domain] = len(local)
      else:
        counts[domain] = int(gpus)
  else:
    counts = np.asarray(failed, dtype=np.int64)
    if counts.ndim != 1:
      raise ValueError(f"failed counts must be one-dimensional, got shape {counts.shape}")
    if num_domains is not None and counts.size != num_domains:
      raise ValueError(f"got {counts.size} failed counts for {num_domains} domains")
  if counts.size and (counts.min() < 0 or counts.max() > tp):
    raise ValueError(f"failed counts must lie in [0, {tp}]")
  return counts


def plan_replicas(failed: Mapping[int, Collection[int] | int] | Sequence[int] | np.ndarray,
                  tp: int, pp: int, power_limit: float = 0.3,
                  policy: Policy | str = Policy.NTP_PW, num_domains: int | None = None,
                  power_curve: PowerCurve = PowerCurve(), degree_rule: DegreeRule = DegreeRule(),
                  pack: bool = True) -> list[ReplicaPlan]:
  """Decides degree, batch share and boost of every replica.

  Args:
    failed: Failed GPUs, as a mapping from domain index to the set of failed
      GPU indices within it (or to their count), or as an array of failed
      counts per domain.
    tp: Domain size, the healthy TP degree.
    pp: Domains (pipeline stages) per replica.
    power_limit: Extra power a boosted GPU may draw, as a fraction of TDP.
    policy: ``"dp-drop"``, ``"ntp"`` or ``"ntp-pw"``.
    num_domains: Number of domains; required when ``failed`` is a mapping.
    power_curve: Speed of a GPU against its power.
    degree_rule: Allowed reduced degrees and batch granularity.
    pack: Put partly failed domains into as few replicas as possible;
      otherwise domain ``d`` stays in replica ``d // pp``.

  Returns:
    One plan per replica, by replica index. When the domain count is not a
    multiple of ``pp`` the leftover domains (the most failed, when packing)
    are in no replica.

  Raises:
    ValueError: On malformed ``failed`` or sizes below 1.
  """
  if tp < 1 or pp < 1:
    raise ValueError(f"tp and pp must be >= 1, got {tp}, {pp}")
  policy = Policy(policy)
  settings = PolicySettings(power_limit=power_limit, power_curve=power_curve,
                            degree_rule=degree_rule, pack=pack)
  counts = _failed_counts(failed, tp, num_domains)
  degrees = domain_degrees(counts, tp, settings)
  order = group_domains(counts.size, degrees, pp, pack)
  plans = []
  for replica, start in enumerate(range(0, order.size, pp)):
    domains = np.sort(order[start:start + pp])
    stage = degrees[domains]
    bottleneck = int(stage.min())
    share = float(replica_shares(bottleneck, tp, policy, settings))
    boosts = np.ones(pp)
    if share == 0.0:
      stage = np.zeros(pp, dtype=np.int64)
      bottleneck = 0
    elif policy is Policy.DP_DROP:
      stage = np.full(pp, tp)
    elif policy is Policy.NTP:
      stage = np.full(pp, bottleneck)
    else:
      # Each stage must process `share` of a healthy batch as fast as a healthy stage.
      boosts = np.asarray(power_curve.power_for_speedup(share * tp / stage, power_limit))
    plans.append(ReplicaPlan(
        replica=replica, domains=tuple(int(d) for d in domains),
        stage_degrees=tuple(int(d) for d in stage),
        stage_boosts=tuple(float(b) for b in boosts), degree=bottleneck, batch_share=share,
        boost=float(boosts.max()), degraded=bool(bottleneck < tp or share < 1.0)))
  return plans


def global_batch_fractions(plans: Sequence[ReplicaPlan]) -> list[float]:
  """Fraction of the global mini-batch each planned replica takes.

  Args:
    plans: Output of ``plan_replicas``.

  Returns:
    Batch shares normalised to sum to 1, in the order of ``plans``.

  Raises:
    ValueError: If no replica can run.
  """
  total = sum(p.batch_share for p in plans)
  if total <= 0:
    raise ValueError("no replica can run")
  return [p.batch_share / total for p in plans]
