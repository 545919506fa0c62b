"""Uniformly placed failures: failed GPUs per domain for a given failed count."""

from __future__ import annotations

import numpy as np

from ntp_jax.sim.cluster import ClusterSpec


def failed_gpus_for_fraction(spec: ClusterSpec, fraction: float) -> int:
  """Failed GPUs closest to ``fraction`` of the job, in whole failure events.

  Args:
    spec: The cluster.
    fraction: Fraction of the job's GPUs that are failed, in ``[0, 1]``.

  Returns:
    A multiple of ``spec.blast_radius``.

  Raises:
    ValueError: If ``fraction`` is outside ``[0, 1]``.
  """
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
  events = int(round(fraction * spec.num_gpus / spec.blast_radius))
  return events * spec.blast_radius


def sample_failed_counts(spec: ClusterSpec, num_failed: int, num_samples: int,
                         rng: np.random.Generator, spare_domains: int = 0) -> np.ndarray:
  """Failed GPUs per domain for uniformly random placements of the failures.

  Failure events pick distinct failure units (``spec.blast_radius`` GPUs of
  one domain) uniformly without replacement over all domains, spares
  included; this is a multivariate hypergeometric draw, so no per-GPU loop.

  Args:
    spec: The cluster.
    num_failed: Failed GPUs; rounded down to whole events.
    num_samples: Independent placements to draw.
    rng: Random generator (its state advances).
    spare_domains: Extra domains beyond the job's, sharing the failures.

  Returns:
    Int array ``[num_samples, spec.num_domains + spare_domains]``.

  Raises:
    ValueError: If ``num_failed`` is negative or exceeds the GPUs available.
  """
  num_domains = spec.num_domains + spare_domains
  events = num_failed // spec.blast_radius
  if events < 0 or events > num_domains * spec.units_per_domain:
    raise ValueError(f"num_failed {num_failed} does not fit {num_domains} domains of {spec.tp}")
  if events == 0:
    return np.zeros((num_samples, num_domains), dtype=np.int64)
  units = rng.multivariate_hypergeometric(np.full(num_domains, spec.units_per_domain), events,
                                          size=num_samples, method="count")
  return units * spec.blast_radius
