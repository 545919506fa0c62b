"""Live recovery: the new plan's state from the live DP peers of the old one.

A failure (or repair) changes the set of failed ``(replica, slot)`` pairs;
the planner makes the new plan (``ntp_jax.parallel.plan.make_plan``), and the new
class programs are filled through ``placement.place_logical`` from a
``PeerSource``: the live state of the old programs. Every replica holds
identical state, so each logical piece is taken from a replica whose devices
holding it are alive; the failed device is never read (``poison`` overwrites
its buffers with NaN first, so a wrong read would show in the loss). Pieces
move device to device (``jax.device_put`` of single-device buffers and the
class's resharding program); no array passes through the host. Source:
Arfeen et al., arXiv:2504.06095, Sec. 3-4 (reduced TP degree after a
failure); the live reshard from DP peers is our own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.program_cache import ProgramCache
from ntp_jax.sharding.mesh import DP, TP
from ntp_jax.state.peer_supply import Holder, Supply, SupplyChoice
from ntp_jax.state.peer_transfer import CrossProcessPeers
from ntp_jax.state.placement import (
  BaseSource,
  EvenPieces,
  Leaf,
  Path,
  block_shape,
  copy_of_replica,
  leaves_of,
  per_device,
)


def poison(programs: list, dead: set[jax.Device]) -> None:
  """Overwrite every buffer the ``dead`` devices hold with NaN (integers: -1), in place.

  A failed device's memory is gone: after this, anything that still read it
  would carry NaN into the loss.
  """
  def spoil(array):
    if not isinstance(array, jax.Array) or not dead & set(array.sharding.device_set):
      return array
    bad = np.nan if jnp.issubdtype(array.dtype, jnp.inexact) else -1
    pieces = [jax.device_put(np.full(s.data.shape, bad, s.data.dtype), s.device)
              if s.device in dead else s.data for s in array.addressable_shards]
    return jax.make_array_from_single_device_arrays(array.shape, array.sharding, pieces)

  for program in programs:
    program.params = jax.tree.map(spoil, program.params)
    program.opt_state = jax.tree.map(spoil, program.opt_state)


class PeerSource(BaseSource):
  """Logical state from the live replicas of the old programs (a ``LogicalSource``).

  Which replica supplies each piece is ``peer_supply.SupplyChoice``'s
  decision; this class moves the chosen pieces (device to device).

  Args:
    programs: the old plan's class programs (their state poisoned on ``dead``).
    dead: devices that failed (never read).
    min_degree: the new plan's smallest TP degree: every target class then
      asks for the same even split, and the old state is moved to it once.
    devices: the job's devices; in a multi-process job the live ones carry the
      moves between processes (``over_processes``).
    cache: where the programs of the moves are kept (the run's ``ProgramCache``, so
      that a move compiled ahead is the one run; default: a fresh one).

  Every split leaf is handed over as blocks (``read_blocks``), every unsplit one as
  the class's own copies (``read_copies``).

  Raises (from ``read_blocks``, ``read_copies``, ``read``):
    LookupError: some piece has no live copy in any replica (then the
      caller falls back to the last checkpoint).
  """

  serves_blocks = True
  serves_copies = True

  def __init__(self, programs: list, dead: set[jax.Device], min_degree: int | None = None,
               devices: Sequence[jax.Device] | None = None, cache: ProgramCache | None = None):
    self.programs = programs
    self.cache = cache or ProgramCache()
    self.dead = dead
    self.devices = list(devices) if devices is not None else None
    self.min_degree = min_degree
    self.copied_bytes = 0  # bytes copied between devices for the new plan
    self.crossed_bytes = 0  # of those, bytes that changed process
    self._leaves: dict[int, dict[Path, Leaf]] = {}
    self._node_index: dict[int, dict[Path, Any]] = {}
    self._moves: dict[Any, EvenPieces] = {}
    self._moved: dict[Any, dict[Path, jax.Array]] = {}
    self.choice = SupplyChoice([Holder(p.mesh.devices, self._leaves_by_path(p))
                                for p in programs], dead)

  def _even_pieces(self, index: int, wanted: dict[Path, int]) -> EvenPieces:
    """The move of old class ``index``'s split leaves ``wanted`` (``path -> k``) to their
    even pieces (``placement.EvenPieces``; none for unsplit leaves only)."""
    key = (index, frozenset(wanted.items()))
    if key not in self._moves:
      program = self.programs[index]
      self._moves[key] = EvenPieces({"params": program.params, "opt_state": program.opt_state},
                                    program.mesh, wanted, self.cache)
    return self._moves[key]

  def _pieces_of(self, index: int, wanted: dict[Path, int]):
    """``(move, moved)``: ``_even_pieces`` and its result, memoised: the target classes
    of the new plan ask for the same split, and the old state moves to it once."""
    move = self._even_pieces(index, wanted)
    key = (index, frozenset(wanted.items()))
    if key not in self._moved:
      self._moved[key] = move()
    return move, self._moved[key]

  def _rows_in_place(self, leaves: list[Leaf], mesh) -> list | None:
    """Per target row, the ``(old program, row)`` holding it as it is, or None when
    some target replica is not an old live replica with the same layouts."""
    rows = []
    for target_row in mesh.devices:
      if any(d in self.dead for d in target_row):
        return None
      match = next(((program, r) for program in self.programs
                    for r, row in enumerate(program.mesh.devices)
                    if tuple(row) == tuple(target_row)), None)
      if match is None:
        return None
      rows.append(match)
    for program, _ in rows:
      for leaf in leaves:
        old = self._leaves_by_path(program).get(leaf.path)
        if old is None or (old.layout, old.axis, old.shape, old.dtype, old.stacked) != (
            leaf.layout, leaf.axis, leaf.shape, leaf.dtype, leaf.stacked):
          return None
    return rows

  def keeps_in_place(self, leaves: list[Leaf], mesh) -> bool:
    return self._rows_in_place(leaves, mesh) is not None

  def in_place(self, leaves: list[Leaf], mesh) -> dict[Path, jax.Array] | None:
    """A target class whose every replica is an old replica, on the same devices and
    with the same layouts, all alive: its state stays where it is (no copy, no
    program). Returns ``path -> array`` in the class sharding, or None."""
    rows = self._rows_in_place(leaves, mesh)
    if rows is None:
      return None
    replicas, degree = mesh.devices.shape
    out = {}
    for leaf in leaves:
      if leaf.layout is not None:
        shape, spec = (replicas, degree) + block_shape(leaf), P(DP, TP)
      elif leaf.stacked:
        shape, spec = (replicas,) + leaf.shape, P(DP)
      else:
        shape, spec = leaf.shape, P()
      pieces = []
      for (program, _), target_row in zip(rows, mesh.devices):
        node = self._nodes(program)[leaf.path]
        value = node.get_value() if isinstance(node, nnx.Variable) else node
        by_device = {s.device: s.data for s in value.addressable_shards}
        pieces += [by_device[d] for d in target_row]
      out[leaf.path] = jax.make_array_from_single_device_arrays(
          shape, NamedSharding(mesh, spec), pieces)
    return out

  def _leaves_by_path(self, program) -> dict[Path, Leaf]:
    if id(program) not in self._leaves:
      self._index(program)
    return self._leaves[id(program)]

  def _nodes(self, program) -> dict[Path, Any]:
    if id(program) not in self._node_index:
      self._index(program)
    return self._node_index[id(program)]

  def _index(self, program) -> None:
    leaves, _, nodes = leaves_of({"params": program.params, "opt_state": program.opt_state})
    self._leaves[id(program)] = {leaf.path: leaf for leaf in leaves}
    self._node_index[id(program)] = {leaf.path: node for leaf, node in zip(leaves, nodes)}

  def over_processes(self, target: Any, meshes: list, t_min: int, *, run: bool = True
                     ) -> CrossProcessPeers:
    """A multi-process job: the new plan's state spanning its replicas, moved from the live
    old classes in one program over the live devices (``peer_transfer``). ``run=False``:
    the moves planned and their programs made, nothing run (``CrossProcessPeers.lower``).

    Raises:
      LookupError: some piece has no live copy (then the caller restores a checkpoint).
    """
    devices = self.devices if self.devices is not None else jax.devices()
    live = [d for d in devices if d not in self.dead]
    moved = CrossProcessPeers(self.programs, self.dead, live, target, meshes, t_min, self.cache)
    if not run:
      return moved
    self.copied_bytes += moved.copied_bytes
    self.crossed_bytes = moved.crossed_bytes
    return moved.move()

  def pieces(self, leaf: Leaf) -> int:
    """Even pieces for ``leaf``: a split the source class and every target class can hold."""
    return self.choice.pieces(leaf, self.min_degree)

  def describe(self) -> str:
    return f"live DP peers ({len(self.dead)} failed device(s))"

  def read_blocks(self, requests: dict[Path, jax.ShapeDtypeStruct]
                  ) -> dict[Path, dict[jax.Device, jax.Array]]:
    """Split leaves as ``[1, 1, *piece]`` buffers on each requested device."""
    return self._gather(requests, as_blocks=True)

  def read_copies(self, requests: dict[Path, jax.ShapeDtypeStruct]
                  ) -> dict[Path, dict[jax.Device, jax.Array]]:
    """Unsplit leaves: a live replica's own buffer (``[1, *shape]`` when replica-stacked,
    the whole array when bare) on each requested device. Nothing is computed: a buffer
    already on the device is handed over as it is (the old state is not used again)."""
    supplies, _ = self._choose(requests)
    out = {}
    for path, request in requests.items():
      node = self._nodes(self.programs[supplies[path].holder])[path]
      value = node.get_value() if isinstance(node, nnx.Variable) else node
      by_device = per_device(value)
      pieces = {}
      for device in request.sharding.mesh.devices.flat:
        source_device, _ = self.choice.whole_source(supplies[path], device)
        piece = by_device[source_device]
        if source_device != device:
          self.copied_bytes += piece.nbytes
        pieces[device] = jax.device_put(piece, device)
      out[path] = pieces
    return out

  def read(self, requests: dict[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.Array]:
    return self._gather(requests, as_blocks=False)

  def read_programs(self, blocks: dict[Path, jax.ShapeDtypeStruct],
                    copies: dict[Path, jax.ShapeDtypeStruct],
                    rest: dict[Path, jax.ShapeDtypeStruct]) -> list[EvenPieces] | None:
    """The moves of the old classes' split leaves to the even pieces the requests want
    (``placement.EvenPieces``, the ones the reads run); copies run none. None when some
    piece has no live copy (the recovery will take the restart path)."""
    requests = {**blocks, **copies, **rest}
    try:
      supplies, ks = self._choose(requests)
    except LookupError:
      return None
    return [self._even_pieces(index, wanted)
            for index, wanted in self._wanted_by_holder(supplies, ks).items() if wanted]

  def _choose(self, requests: dict[Path, jax.ShapeDtypeStruct]
              ) -> tuple[dict[Path, Supply], dict[Path, int]]:
    """Per path, the supplying replicas and ``k``, the even pieces requested (the target
    mesh's columns; 1 when unsplit). Raises LookupError naming a path without a live copy."""
    supplies: dict[Path, Supply] = {}
    ks: dict[Path, int] = {}
    for path, request in requests.items():
      ks[path] = request.sharding.mesh.devices.shape[1] if request.sharding.spec else 1
      supply = self.choice.choose(path, ks[path])
      if supply is None:
        raise LookupError(f"{'/'.join(path)}: no live replica holds every piece")
      supplies[path] = supply
    return supplies, ks

  def _wanted_by_holder(self, supplies: dict[Path, Supply], ks: dict[Path, int]
                        ) -> dict[int, dict[Path, int]]:
    """Per supplying old class, its split leaves to move and their ``k``."""
    out = {}
    for index in dict.fromkeys(s.holder for s in supplies.values()):
      program = self.programs[index]
      out[index] = {p: ks[p] for p, s in supplies.items()
                    if s.holder == index and self._leaves_by_path(program)[p].layout is not None}
    return out

  def _gather(self, requests, as_blocks: bool):
    supplies, ks = self._choose(requests)
    moved_by_holder = {}
    for index, wanted in self._wanted_by_holder(supplies, ks).items():
      move, moved = self._pieces_of(index, wanted)
      moved_by_holder[index] = ({leaf.path: (leaf, node)
                                 for leaf, node in zip(move.leaves, move.nodes)}, moved)
    out = {}
    for path, request in requests.items():
      supply = supplies[path]
      by_path, moved = moved_by_holder[supply.holder]
      leaf, node = by_path[path]
      target = request.sharding.mesh.devices  # [target replicas, k]
      by_device = per_device(moved[path]) if leaf.layout is not None else {}
      pieces = []
      for target_row in target:
        for j, device in enumerate(target_row):
          # Prefer a copy that is already on the target device: nothing moves then.
          if leaf.layout is not None:
            source_device, _ = self.choice.piece_source(supply, j, device)
            piece = by_device[source_device]  # [1, 1, *piece]
            if not as_blocks:
              piece = piece.reshape(leaf.piece_shape)
          else:
            source_device, row = self.choice.whole_source(supply, device)
            piece = copy_of_replica(node, leaf, source_device, row)
          if source_device != device:
            self.copied_bytes += piece.nbytes
          pieces.append(jax.device_put(piece, device))
      pieces = [p if p.dtype == request.dtype else p.astype(request.dtype) for p in pieces]
      if as_blocks:
        out[path] = dict(zip([d for row in target for d in row], pieces))
      else:
        out[path] = jax.make_array_from_single_device_arrays(
            tuple(request.shape), request.sharding, pieces)
    return out
