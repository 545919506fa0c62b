"""What a failure does to a step under each batch policy: its tokens, or its time.

``proportional`` (``ntp.rebalance``'s default): the live replicas take shares
in proportion to their speed, so the step keeps its time and loses tokens.
``constant``: the step keeps the healthy job's tokens, spread over the live
replicas in proportion to their speed, so every live device does more work
and the step takes longer. With shares that divide finely both give the job
the same throughput; the choice is between the optimisation trajectory
(constant: failures leave every step's sequences as in the healthy run) and
the step's length. Measured on a 2 x 4 CPU plan, with whole sequences, in
``bench/ntp_vs_dropping.py``.
"""

from __future__ import annotations

import numpy as np

BATCH_POLICIES = ("proportional", "constant")


def step_shape(capacity, target, batch_policy: str) -> tuple[np.ndarray, np.ndarray]:
  """``(tokens per step, step time)``, both relative to the healthy job's.

  Args:
    capacity: float array: the samples the live replicas process in a
      healthy step's time, in healthy local batches (``policies.job_capacity``).
    target: the healthy job's local batches per step (its replicas).
    batch_policy: one of ``BATCH_POLICIES``.

  Returns:
    Float arrays of ``capacity``'s shape. Proportional: ``min(capacity,
    target) / target`` tokens in the healthy time. Constant: every token, in
    ``target / min(capacity, target)`` of the healthy time (the live devices
    at ``T / t`` of their healthy work at worst, when every replica runs at
    degree ``t``); infinite when nothing runs.

  Raises:
    ValueError: an unknown policy, or ``target`` below 1.
  """
  if batch_policy not in BATCH_POLICIES:
    raise ValueError(f"batch policy {batch_policy!r} is not one of {', '.join(BATCH_POLICIES)}")
  if target < 1:
    raise ValueError(f"target must be >= 1 local batch, got {target}")
  used = np.minimum(np.asarray(capacity, dtype=np.float64), target)
  if batch_policy == "proportional":
    return used / target, np.ones_like(used)
  with np.errstate(divide="ignore"):
    return np.ones_like(used), np.where(used > 0, target / np.maximum(used, 1e-300), np.inf)
