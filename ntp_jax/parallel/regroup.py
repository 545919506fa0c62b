"""Where each element of a flattened gradient sits for the peer-group all-reduce.

Every replica moves each flattened parameter (split axis first, shared units
once on the last slot: ``sync_leaf.flat_layout``) onto the job's ``t_min`` core
positions, the same positions for every replica, before the all-reduce
across domains. Buffers must be near-equal in length (the all-reduce pads to
the longest), so position ``j`` holds ``target_j`` elements
(``apportion(size, t_min)``). Which elements go where decides the traffic
inside each domain: an element moves when the position it is synced at is
not the one its replica holds it at.

A ``Regroup`` splits the flat array at ``split``: the *core* part
``[0, split)`` is laid out as ``core`` runs, the *extra* part
``[split, size)`` as ``extra`` runs (position ``j`` holds both, core first).

- ``equal``: no extra part, ``core = target``: the smallest replicas' layout,
  near enough; they move (almost) nothing, wider replicas move about half.
- ``nested on t``: the core runs are a degree-``t`` replica's first ``t_min``
  slots, untouched; its extra slots' elements are cut into the remaining
  room ``target_j - core_j`` of each position. That replica moves only its
  extra slots' elements (``(t - t_min) / t`` of the gradient each way, the
  nested core/extra regroup); replicas of other degrees move more.

``choose_regroup`` picks, per parameter, the candidate that moves the fewest
bytes over every replica of the plan (equal wins ties), so a job of many
healthy replicas and a few reduced ones pays the nested regroup's bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ntp_jax.sharding.collectives import transfer_schedule
from ntp_jax.sharding.layout import Layout, apportion


@dataclasses.dataclass(frozen=True)
class Regroup:
  """The sync positions of one flattened parameter (see the module docstring).

  Attributes:
    size: elements of the flat array. split: first element of the extra part.
    core, extra: elements of each part at positions ``0 .. t_min - 1``.
  """

  size: int
  split: int
  core: tuple[int, ...]
  extra: tuple[int, ...]

  @property
  def t_min(self) -> int:
    return len(self.core)

  @property
  def core_block(self) -> int:
    return max(self.core)

  @property
  def extra_block(self) -> int:
    return max(self.extra) if self.split < self.size else 0

  @property
  def block(self) -> int:
    """Length of one position's buffer (the same for every class)."""
    return self.core_block + self.extra_block

  def positions(self, src: Layout) -> tuple[Layout, Layout | None]:
    """The core and extra parts' layouts over ``src``'s positions (later positions empty)."""
    rest = (0,) * (src.degree - self.t_min)
    core = Layout(tp=src.tp, live_slots=src.live_slots, units=self.core + rest)
    if self.split == self.size:
      return core, None
    return core, Layout(tp=src.tp, live_slots=src.live_slots, units=self.extra + rest)

  def pieces(self, src: Layout) -> tuple[Layout, Layout | None]:
    """``src`` (a flat layout in elements, shared units already folded) cut at ``split``:
    each slot's run is its core piece, then its extra piece."""
    core, extra = [], []
    for offset, size in zip(src.offsets, src.sizes):
      in_core = max(0, min(offset + size, self.split) - offset)
      core.append(in_core)
      extra.append(size - in_core)
    head = Layout(tp=src.tp, live_slots=src.live_slots, units=tuple(core))
    if self.split == self.size:
      return head, None
    return head, Layout(tp=src.tp, live_slots=src.live_slots, units=tuple(extra))

  def moved(self, src: Layout) -> int:
    """Elements a replica of flat layout ``src`` sends to reach these positions (one way)."""
    total = 0
    for piece, place in zip(self.pieces(src), self.positions(src)):
      if piece is not None:
        total += sum(int(t["send_len"].sum()) for t in transfer_schedule(piece, place)
                     if t["shift"])
    return total


def equal_regroup(size: int, t_min: int) -> Regroup:
  """Near-equal contiguous runs, no extra part."""
  return Regroup(size, size, apportion(size, [1.0] * t_min), (0,) * t_min)


def nested_regroup(reference: Layout, t_min: int) -> Regroup | None:
  """Core runs = ``reference``'s first ``t_min`` slots; None where one is longer than its
  position's target (the buffers could not stay near-equal)."""
  size = reference.size
  target = apportion(size, [1.0] * t_min)
  core = tuple(reference.sizes[:t_min])
  if reference.degree <= t_min or any(c > t for c, t in zip(core, target)):
    return None
  split = reference.offsets[t_min]
  return Regroup(size, split, core, tuple(t - c for t, c in zip(target, core)))


def choose_regroup(sources: Sequence[tuple[Layout, int]], t_min: int) -> Regroup:
  """The candidate that moves the fewest elements over every replica.

  Args:
    sources: ``(flat layout, replicas)`` of each class for one parameter.
    t_min: the job's smallest TP degree.
  """
  size = sources[0][0].size
  equal = equal_regroup(size, t_min)
  candidates = [equal]
  for layout, _ in sources:
    nested = nested_regroup(layout, t_min)
    # Never a longer buffer than equal's: the all-reduce across domains stays as it is.
    if nested is not None and nested not in candidates and nested.block <= equal.block:
      candidates.append(nested)
  return min(candidates, key=lambda r: sum(r.moved(src) * n for src, n in sources))
