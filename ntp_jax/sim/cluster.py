"""Shape of the simulated cluster: GPUs, scale-up domains and DP replicas."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  """A job laid out over scale-up domains (Arfeen et al., background).

  A scale-up domain is ``tp`` GPUs on one NVLink fabric; it hosts one TP group,
  so the healthy TP degree equals the domain size. A DP replica spans ``pp``
  domains, one per pipeline stage. A failure takes out ``blast_radius`` GPUs
  of one domain at once (an aligned group, for example the GPUs of one tray).

  Attributes:
    num_gpus: GPUs the job uses when healthy, spares excluded.
    tp: GPUs per scale-up domain, which is the healthy TP degree.
    pp: Domains (pipeline stages) per DP replica.
    blast_radius: GPUs lost per failure event; must divide ``tp``.

  Raises:
    ValueError: If a size is below 1, ``num_gpus`` is not a whole number of
      replicas, or ``blast_radius`` does not divide ``tp``.
  """

  num_gpus: int
  tp: int
  pp: int = 1
  blast_radius: int = 1

  def __post_init__(self):
    for name in ("num_gpus", "tp", "pp", "blast_radius"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
    if self.num_gpus % (self.tp * self.pp):
      raise ValueError(f"num_gpus: {self.num_gpus} is not a multiple of tp * pp = "
                       f"{self.tp * self.pp}")
    if self.tp % self.blast_radius:
      raise ValueError(f"blast_radius: {self.blast_radius} does not divide tp {self.tp}")

  @property
  def num_domains(self) -> int:
    """Scale-up domains the healthy job uses."""
    return self.num_gpus // self.tp

  @property
  def num_replicas(self) -> int:
    """DP replicas of the healthy job; its mini-batch is this many local batches."""
    return self.num_domains // self.pp

  @property
  def units_per_domain(self) -> int:
    """Failure units (groups of ``blast_radius`` GPUs) in one domain."""
    return self.tp // self.blast_radius
