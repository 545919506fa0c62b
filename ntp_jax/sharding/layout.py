"""Layouts: which shard units of one tensor-parallel dimension each live slot holds.

A TP group has ``tp`` nominal slots; some may have failed. A dimension of
``num_units`` shard units (KV-head groups for attention, ``ffn_granularity``
columns of the MLP, ``vocab_granularity`` rows of the vocabulary) is split into
contiguous runs, one per live slot, with sizes proportional to the slots' speed
weights (equal by default) and rounded to whole units by the largest-remainder
method. Sizes may differ by slot and may be zero.

Source: Arfeen et al., "Nonuniform-Tensor-Parallelism", arXiv:2504.06095,
Sec. 3 (reduced TP degree after a failure) and Sec. 4 (shard placement).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
  """Contiguous split of ``num_units`` shard units over the live slots of a TP group.

  Attributes:
    tp: nominal slots in the TP group (T).
    live_slots: the live slot indices, ascending; device ``i`` of the group's
      mesh axis holds slot ``live_slots[i]``. Not part of equality or hash:
      the same unit split is the same program whichever slots are live, so
      replicas that lost different slots can share one compiled program.
    units: shard units held by each live slot alone, in live-slot order
      (zero allowed); these runs come first in logical order.
    unit_size: elements of the sharded array dimension per shard unit.
    shared_units: the last ``shared_units`` units of the dimension, held by
      *every* slot after its own run. A layer computes them data-parallel
      inside the TP group (each slot on its part of the positions) instead
      of giving some slots one more unit than others, so no slot computes a
      padded unit. Default 0.

  A slot's block is its own run, zero-padded to the largest own run
  (``own_block_units`` units, ``own_size`` elements), then the shared units.
  """

  tp: int
  live_slots: tuple[int, ...] = dataclasses.field(compare=False)
  units: tuple[int, ...] = ()
  unit_size: int = 1
  shared_units: int = 0

  def __post_init__(self):
    if len(self.live_slots) != len(self.units):
      raise ValueError(
          f"layout: {len(self.live_slots)} live slots but {len(self.units)} unit counts")
    if any(u < 0 for u in self.units):
      raise ValueError(f"layout: negative unit count in {self.units}")
    if self.unit_size < 1:
      raise ValueError(f"layout: unit_size must be >= 1, got {self.unit_size}")
    if self.shared_units < 0:
      raise ValueError(f"layout: shared_units must be >= 0, got {self.shared_units}")
    if self.shared_units and len(set(self.units)) != 1:
      raise ValueError(f"layout: shared units need equal own runs, got {self.units}")

  @property
  def degree(self) -> int:
    """TP degree: the number of live slots."""
    return len(self.live_slots)

  @property
  def num_units(self) -> int:
    return sum(self.units) + self.shared_units

  @property
  def size(self) -> int:
    """Logical length of the sharded dimension, in elements."""
    return self.num_units * self.unit_size

  @property
  def sizes(self) -> tuple[int, ...]:
    """Elements of each live slot's own run (shared units not counted)."""
    return tuple(u * self.unit_size for u in self.units)

  @property
  def offsets(self) -> tuple[int, ...]:
    """Logical start (in elements) of each live slot's run."""
    return tuple(int(o) for o in np.cumsum((0,) + self.sizes[:-1]))

  @property
  def own_block_units(self) -> int:
    """Units in the block's own region: the largest own run."""
    return max(self.units)

  @property
  def own_size(self) -> int:
    """Elements of the block's own region: the slot's own run, zero-padded to the
    largest; the shared units (if any) follow, from here to ``block``."""
    return self.own_block_units * self.unit_size

  @property
  def block_units(self) -> int:
    """Units in the padded block: own region plus shared units (at least 1)."""
    return max(self.own_block_units + self.shared_units, 1)

  @property
  def block(self) -> int:
    """Elements in the padded per-device block."""
    return self.block_units * self.unit_size

  def with_unit_size(self, unit_size: int) -> Layout:
    """The same unit split, measured in another number of elements per unit."""
    return dataclasses.replace(self, unit_size=unit_size)

  def gather_index(self) -> np.ndarray:
    """int32 [degree, block]: logical index of each padded-block entry, -1 for padding."""
    index = np.full((self.degree, self.block), -1, dtype=np.int32)
    own_total = sum(self.sizes)
    shared_start = self.own_size
    for i, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
      index[i, :size] = np.arange(offset, offset + size)
      index[i, shared_start:] = np.arange(own_total, self.size)
    return index

  def scatter_index(self) -> np.ndarray:
    """int32 [size]: position in the flattened ``[degree * block]`` array of each logical
    element (for shared units, the first slot's copy)."""
    flat = self.gather_index().reshape(-1)
    values, first = np.unique(flat, return_index=True)
    return first[values >= 0].astype(np.int32)

  def describe(self) -> str:
    """Short text such as ``'3,3,2 x4'`` (units per live slot x elements per unit)."""
    text = ",".join(str(u) for u in self.units)
    if self.shared_units:
      text += f" +{self.shared_units} shared"
    return text if self.unit_size == 1 else f"{text} x{self.unit_size}"


def live_slots(tp: int, failed: Sequence[int] = ()) -> tuple[int, ...]:
  """Live slots of a TP group of ``tp`` slots with ``failed`` slots removed.

  Raises:
    ValueError: naming the argument: ``tp`` < 1, more ``failed`` slots than
      ``tp``, a failed slot outside ``[0, tp)``, a repeated failed slot, or
      every slot failed.
  """
  if tp < 1:
    raise ValueError(f"live_slots: tp must be >= 1, got {tp}")
  failed = list(failed)
  if len(failed) > tp:
    raise ValueError(f"live_slots: {len(failed)} failed slots but tp is {tp}")
  for slot in failed:
    if not 0 <= slot < tp:
      raise ValueError(f"live_slots: failed slot {slot} is outside [0, {tp})")
  if len(set(failed)) != len(failed):
    raise ValueError(f"live_slots: repeated slot in failed {sorted(failed)}")
  live = tuple(s for s in range(tp) if s not in set(failed))
  if not live:
    raise ValueError(f"live_slots: failed lists all {tp} slots; none is live")
  return live


def apportion(num_units: int, weights: Sequence[float]) -> tuple[int, ...]:
  """Split ``num_units`` whole units in proportion to ``weights`` (largest remainder).

  Each share gets ``floor(num_units * w / sum(w))`` units; the units left over
  go to the largest fractional remainders, ties to the lower index. The result
  sums to ``num_units`` exactly.

  Raises:
    ValueError: naming the argument: no ``weights``, a negative or non-finite
      weight, all weights zero, or ``num_units`` < 0.
  """
  weights = np.asarray(weights, dtype=np.float64)
  if weights.size == 0:
    raise ValueError("apportion: weights is empty; nothing to apportion over")
  if not np.all(np.isfinite(weights)):
    raise ValueError(f"apportion: weights must be finite, got {weights.tolist()}")
  if np.any(weights < 0):
    raise ValueError(f"apportion: weights must be >= 0, got {weights.tolist()}")
  if weights.sum() <= 0:
    raise ValueError(f"apportion: weights need a positive entry, got {weights.tolist()}")
  if num_units < 0:
    raise ValueError(f"apportion: num_units must be >= 0, got {num_units}")
  quotas = num_units * weights / weights.sum()
  units = np.floor(quotas).astype(np.int64)
  left = num_units - int(units.sum())
  # Stable sort on the negated remainder: ties go to the lower slot index.
  order = np.argsort(-(quotas - units), kind="stable")
  units[order[:left]] += 1
  return tuple(int(u) for u in units)


def make_layout(
    num_units: int,
    tp: int,
    *,
    failed: Sequence[int] = (),
    weights: Sequence[float] | None = None,
    unit_size: int = 1,
    share_remainder: bool = False,
) -> Layout:
  """Layout of ``num_units`` shard units over the live slots of a TP group.

  Args:
    num_units: shard units of the dimension (e.g. KV heads, d_ff / granularity).
    tp: nominal slots in the TP group.
    failed: failed slot indices.
    weights: per-slot relative speeds, one per nominal slot (failed slots'
      weights are ignored); ``None`` means equal.
    unit_size: elements per unit.
    share_remainder: with equal weights and at least one unit per live slot,
      split ``num_units // degree`` units to every slot and share the
      ``num_units % degree`` left over (see ``Layout.shared_units``) instead
      of giving some slots one more.

  Raises:
    ValueError: naming the argument (see ``live_slots`` and ``apportion``);
      ``weights`` not of length ``tp``.
  """
  live = live_slots(tp, failed)
  per_slot, left = divmod(num_units, len(live))
  if share_remainder and weights is None and per_slot >= 1 and left:
    return Layout(tp=tp, live_slots=live, units=(per_slot,) * len(live), unit_size=unit_size,
                  shared_units=left)
  if weights is None:
    live_weights = [1.0] * len(live)
  else:
    weights = list(weights)
    if len(weights) != tp:
      raise ValueError(
          f"make_layout: weights has {len(weights)} entries, expected tp={tp} (one per slot)")
    live_weights = [weights[s] for s in live]
  return Layout(tp=tp, live_slots=live, units=apportion(num_units, live_weights),
                unit_size=unit_size)


def units_of(dim: int, granularity: int) -> int:
  """Number of shard units in ``dim`` elements of ``granularity`` each.

  Raises:
    ValueError: naming the argument: ``granularity`` < 1, or ``granularity``
      does not divide ``dim``.
  """
  if granularity < 1:
    raise ValueError(f"units_of: granularity must be >= 1, got {granularity}")
  if dim % granularity:
    raise ValueError(f"units_of: granularity {granularity} does not divide dim {dim}")
  return dim // granularity


def owner_layout(layout: Layout) -> Layout:
  """``layout`` with its shared units owned by the last slot alone (after its own run).

  Shared units are the last units in logical order and every slot's block
  ends with them; counting them on the last slot makes the split a set of
  contiguous runs that ``reshard_uneven`` can move. The block is unchanged.
  """
  if not layout.shared_units:
    return layout
  units = layout.units[:-1] + (layout.units[-1] + layout.shared_units,)
  return Layout(tp=layout.tp, live_slots=layout.live_slots, units=units,
                unit_size=layout.unit_size)
