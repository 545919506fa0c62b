"""Throughput loss against the fraction of failed GPUs (Arfeen et al., Figure 6)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ntp_jax.sim.cluster import ClusterSpec
from ntp_jax.sim.placement import failed_gpus_for_fraction, sample_failed_counts
from ntp_jax.sim.policies import ALL_POLICIES, Policy, PolicySettings, throughput_loss

_CHUNK = 2000  # placements evaluated at once; bounds memory, not results


@dataclasses.dataclass(frozen=True)
class LossPoint:
  """Loss statistics of one policy at one failed fraction.

  Attributes:
    fraction: Failed GPUs over the job's GPUs, as simulated (whole events).
    failed_gpus: Failed GPUs.
    policy: Policy name.
    mean_loss: Mean throughput loss over placements, in ``[0, 1]``.
    max_loss: Largest throughput loss over placements.
    min_loss: Smallest throughput loss over placements.
  """

  fraction: float
  failed_gpus: int
  policy: str
  mean_loss: float
  max_loss: float
  min_loss: float


def loss_sweep(spec: ClusterSpec, fractions: Sequence[float], settings: PolicySettings,
               policies: Sequence[Policy] = ALL_POLICIES, num_samples: int = 1000,
               seed: int = 0, spare_domains: int = 0) -> list[LossPoint]:
  """Mean and max loss of each policy over random failure placements.

  All policies see the same placements. A point with ``k`` failed GPUs draws
  from a generator seeded with ``(seed, k)``, so its placements do not depend
  on the other points of the sweep.

  Args:
    spec: The cluster.
    fractions: Failed fractions of the job's GPUs.
    settings: Policy settings.
    policies: Policies to compare.
    num_samples: Placements per fraction.
    seed: Seed of the placements.
    spare_domains: Spare domains that may replace failed ones; they fail too.

  Returns:
    One ``LossPoint`` per fraction and policy, fraction-major.

  Raises:
    ValueError: If ``num_samples`` is below 1 or a fraction is out of range.
  """
  if num_samples < 1:
    raise ValueError(f"num_samples must be >= 1, got {num_samples}")
  policies = [Policy(p) for p in policies]
  points = []
  for fraction in fractions:
    failed = failed_gpus_for_fraction(spec, fraction)
    rng = np.random.default_rng([seed, failed])
    losses = {p: [] for p in policies}
    for start in range(0, num_samples, _CHUNK):
      counts = sample_failed_counts(spec, failed, min(_CHUNK, num_samples - start), rng,
                                    spare_domains)
      for policy in policies:
        losses[policy].append(throughput_loss(counts, spec.tp, spec.pp, policy, settings,
                                              spec.num_replicas))
    for policy in policies:
      values = np.concatenate(losses[policy])
      points.append(LossPoint(fraction=failed / spec.num_gpus, failed_gpus=failed,
                              policy=policy.value, mean_loss=float(values.mean()),
                              max_loss=float(values.max()), min_loss=float(values.min())))
  return points
