"""Which TP degree a partly failed domain runs at, and how speed becomes batch share."""

from __future__ import annotations

import dataclasses

import numpy as np

_EPS = 1e-9


@dataclasses.dataclass(frozen=True)
class DegreeRule:
  """Allowed reduced TP degrees and the granularity of a replica's batch.

  By default any degree is allowed (a domain with ``g`` live GPUs runs at TP
  ``g``) and batch shares are continuous, so a replica at degree ``t`` of
  ``T`` takes ``t / T`` of a healthy replica's samples, as in the paper's
  design (Arfeen et al.: e.g. TP62 after 2 of 64 GPUs fail). Its large-scale
  evaluation is coarser: TP32 may fall back to TP30 or TP28 only, and a
  replica's local batch is a whole number of sequences (8 with its batch of
  16M tokens in 16K-token sequences over 128 replicas); pass
  ``allowed_degrees=(32, 30, 28)`` and ``local_batch=8`` to model that.

  Attributes:
    allowed_degrees: Degrees a domain may run at, or ``None`` for any degree.
      The healthy degree is always allowed. A domain with fewer live GPUs than
      the smallest allowed degree cannot run (degree 0).
    local_batch: Samples in a healthy replica's local batch, or ``None`` for
      continuous shares. With a value, shares are rounded down to whole
      samples.

  Raises:
    ValueError: If a degree or ``local_batch`` is below 1.
  """

  allowed_degrees: tuple[int, ...] | None = None
  local_batch: int | None = None

  def __post_init__(self):
    if self.allowed_degrees is not None:
      if not self.allowed_degrees or min(self.allowed_degrees) < 1:
        raise ValueError(f"allowed_degrees must be >= 1, got {self.allowed_degrees}")
      object.__setattr__(self, "allowed_degrees",
                         tuple(sorted(set(int(d) for d in self.allowed_degrees), reverse=True)))
    if self.local_batch is not None and self.local_batch < 1:
      raise ValueError(f"local_batch must be >= 1, got {self.local_batch}")

  def degree_table(self, tp: int) -> np.ndarray:
    """Degree for every count of live GPUs in a domain of ``tp`` GPUs.

    Args:
      tp: Domain size (healthy TP degree).

    Returns:
      Int array of shape ``[tp + 1]``; entry ``g`` is the degree a domain with
      ``g`` live GPUs runs at (the largest allowed degree <= ``g``, or 0).
    """
    live = np.arange(tp + 1)
    if self.allowed_degrees is None:
      return live
    allowed = np.array(sorted({d for d in self.allowed_degrees if d <= tp} | {tp}))
    index = np.searchsorted(allowed, live, side="right") - 1
    return np.where(index >= 0, allowed[np.maximum(index, 0)], 0)

  def batch_share(self, relative_speed):
    """Fraction of a healthy replica's local batch a replica can take.

    Args:
      relative_speed: Replica speed relative to a healthy replica, any shape.

    Returns:
      Float array of the same shape in ``[0, 1]``.
    """
    share = np.clip(np.asarray(relative_speed, dtype=np.float64), 0.0, 1.0)
    if self.local_batch is None:
      return share
    return np.floor(share * self.local_batch + _EPS) / self.local_batch
