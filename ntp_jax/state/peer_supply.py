"""Live recovery, the choice: which old replica supplies each even piece of a leaf.

Pure bookkeeping over the old plan's classes (their device grids and leaf
layouts) and the dead devices: nothing is read or moved here, so it is
tested without data. ``peer.PeerSource`` moves what this chooses.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Hashable, Mapping, Sequence

import numpy as np

from ntp_jax.sharding.collectives import transfer_schedule
from ntp_jax.sharding.layout import owner_layout
from ntp_jax.state.placement import Leaf, Path, even_pieces


@dataclasses.dataclass(frozen=True)
class Holder:
  """One class of the old plan, as the choice sees it.

  Attributes:
    devices: ``[replicas, degree]`` grid of its devices (its class mesh).
    leaves: ``path -> Leaf`` of its state (layouts at its degree).
  """

  devices: np.ndarray
  leaves: Mapping[Path, Leaf]

  @property
  def replicas(self) -> int:
    return self.devices.shape[0]

  @property
  def degree(self) -> int:
    return self.devices.shape[1]


@dataclasses.dataclass(frozen=True)
class Supply:
  """Where the pieces of one leaf come from.

  Attributes:
    holder: index of the supplying class among the choice's holders.
    rows: for each even piece ``j``, the replicas (rows of the holder's
      grid) whose devices holding it are all alive; an unsplit leaf has one
      entry: the replicas with any live device.
  """

  holder: int
  rows: tuple[tuple[int, ...], ...]


def piece_sources(leaf: Leaf) -> list[set[int]]:
  """For each even piece ``j`` of a split ``leaf`` (``leaf.pieces`` of them): the live-slot
  positions whose blocks it is made from."""
  sources: list[set[int]] = [set() for _ in range(leaf.pieces)]
  for t in transfer_schedule(owner_layout(leaf.layout), leaf.even_layout):
    for i, length in enumerate(t["send_len"]):
      if length > 0:
        sources[i + t["shift"]].add(i)
  return sources


class SupplyChoice:
  """Chooses, for each leaf, an old class and replicas whose live devices hold every piece.

  Args:
    holders: the old plan's classes, in plan order (earlier ones preferred).
    dead: devices that failed (never chosen).
  """

  def __init__(self, holders: Sequence[Holder], dead: Collection[Hashable]):
    self.holders = list(holders)
    self.dead = dead

  def _alive(self, holder: Holder, replica: int, positions) -> bool:
    return all(holder.devices[replica, i] not in self.dead for i in positions)

  def choose(self, path: Path, k: int) -> Supply | None:
    """The first class that can supply ``path`` cut into ``k`` even pieces (unsplit leaves:
    ``k`` is ignored), or None when no class has a live copy of every piece."""
    for index, holder in enumerate(self.holders):
      leaf = holder.leaves[path]
      if leaf.layout is None:
        rows = tuple(r for r in range(holder.replicas)
                     if any(self._alive(holder, r, [i]) for i in range(holder.degree)))
        if rows:
          return Supply(index, (rows,))
        continue
      if k > holder.degree:
        continue
      per_piece = []
      for positions in piece_sources(dataclasses.replace(leaf, k=k)):
        alive = tuple(r for r in range(holder.replicas) if self._alive(holder, r, positions))
        if not alive:
          break
        per_piece.append(alive)
      else:
        return Supply(index, tuple(per_piece))
    return None

  def pieces(self, leaf: Leaf, min_degree: int | None) -> int:
    """Even pieces for a split target ``leaf``: a split some old class can supply and
    every target class can hold (``k <= min_degree``, the new plan's smallest degree)."""
    n = leaf.layout.size
    target = min(leaf.layout.degree, min_degree or leaf.layout.degree)
    for holder in self.holders:
      k = even_pieces(n, min(holder.degree, target))
      if self.choose(leaf.path, k) is not None:
        return k
    return even_pieces(n, leaf.layout.degree)

  def piece_source(self, supply: Supply, j: int, device: Hashable) -> tuple[Hashable, int]:
    """``(source device, replica row)`` of piece ``j`` for ``device``: ``device`` itself
    when it holds a live copy (nothing moves), else the first live copy."""
    holder = self.holders[supply.holder]
    options = [holder.devices[r, j] for r in supply.rows[j]]
    source = device if device in options else options[0]
    return source, supply.rows[j][options.index(source)]

  def whole_source(self, supply: Supply, device: Hashable) -> tuple[Hashable, int]:
    """``(source device, replica row)`` of an unsplit leaf for ``device``: ``device`` itself
    when it is a live device of a chosen replica, else the first live one."""
    holder = self.holders[supply.holder]
    options = [(d, r) for r in supply.rows[0] for d in holder.devices[r] if d not in self.dead]
    return next(((d, r) for d, r in options if d == device), options[0])
