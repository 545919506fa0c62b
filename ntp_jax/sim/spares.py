"""Spare domains needed to keep a fixed mini-batch running (Arfeen et al., Figure 7).

With a fixed mini-batch the job runs only while its replicas can take the
whole mini-batch (``spec.num_replicas`` healthy local batches) in one step;
otherwise it pauses until repairs. Spare domains join the pool the job forms
replicas from (they fail too); extra replicas take part of the batch. Spares
cost GPUs that sit idle while healthy, so per-GPU throughput falls as they
are added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ntp_jax.sim.cluster import ClusterSpec
from ntp_jax.sim.failures import FailureModel, sample_timeline
from ntp_jax.sim.policies import ALL_POLICIES, Policy, PolicySettings, job_capacity

_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class SparesResult:
  """Pause time and per-GPU throughput against the number of spare domains.

  Attributes:
    spares: Int array ``[num_options]`` of spare-domain counts tried.
    running_fraction: Policy name to float array ``[num_options]``: share of
      the timeline the job runs.
    per_gpu_throughput: Policy name to float array ``[num_options]``:
      throughput per GPU (spares included) relative to a healthy job with no
      spares.
    needed: Policy name to the least spares that never pause, or ``None``
      when none of the counts tried suffices.
  """

  spares: np.ndarray
  running_fraction: dict[str, np.ndarray]
  per_gpu_throughput: dict[str, np.ndarray]
  needed: dict[str, int | None]


def spares_needed(spec: ClusterSpec, model: FailureModel, settings: PolicySettings,
                  max_spares: int, days: float = 15.0, step_hours: float = 1.0, seed: int = 0,
                  policies: Sequence[Policy] = ALL_POLICIES) -> SparesResult:
  """Runs one failure timeline over the job plus ``max_spares`` spare domains.

  For ``s`` spares only the first ``s`` spare domains exist, so all counts
  share one timeline. Spares are always packed in (a restart may re-form
  replicas), whatever ``settings.pack`` says.

  Args:
    spec: The cluster (its healthy job sets the mini-batch).
    model: Failure and repair process.
    settings: Policy settings.
    max_spares: Largest number of spare domains tried (all of 0..max_spares).
    days: Length of the window.
    step_hours: Grid spacing.
    seed: Seed of the timeline.
    policies: Policies to evaluate.

  Returns:
    The spares result.

  Raises:
    ValueError: If ``max_spares`` is negative.
  """
  if max_spares < 0:
    raise ValueError(f"max_spares must be >= 0, got {max_spares}")
  rng = np.random.default_rng(seed)
  timeline = sample_timeline(spec, model, days * 24.0, step_hours, rng, max_spares)
  packed = dataclasses.replace(settings, pack=True)
  options = np.arange(max_spares + 1)
  running, per_gpu, needed = {}, {}, {}
  for policy in policies:
    policy = Policy(policy)
    fractions = np.empty(len(options))
    for s in options:
      counts = timeline.failed_counts[:, :spec.num_domains + s]
      capacity = job_capacity(counts, spec.tp, spec.pp, policy, packed)
      fractions[s] = np.mean(capacity >= spec.num_replicas - _EPS)
    running[policy.value] = fractions
    per_gpu[policy.value] = fractions * spec.num_domains / (spec.num_domains + options)
    never_paused = np.flatnonzero(fractions >= 1.0)
    needed[policy.value] = int(never_paused[0]) if never_paused.size else None
  return SparesResult(spares=options, running_fraction=running, per_gpu_throughput=per_gpu,
                      needed=needed)
