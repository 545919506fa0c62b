"""Live recovery across processes: the new plan's state from DP peers on other hosts.

In one process ``peer.PeerSource`` moves pieces with ``jax.device_put``;
across processes a device cannot be written by a process that does not drive
it (and CPU backends have no cross-host ``device_put``). So here the moves
are one collective program over every live device of the job:

1. each process cuts the old classes it holds into even pieces
   (``placement.even_pieces_of``, ``k`` pieces per split leaf, the job's
   spanning split, ``spanning.job_pieces``);
2. every process computes the same schedule from the plan alone: for each
   piece a device of the new plan needs, a live old device that holds it
   (the device itself when it does: nothing moves; else one of the same
   process; else one of another process);
3. moves within a process are ``jax.device_put``; moves between processes
   go in rounds of ``jax.lax.ppermute`` (each device sends and receives at
   most one piece per round) inside one ``shard_map`` program over the live
   devices, which every live process calls with its own devices' buffers;
4. the result is the job's logical state spanning the new plan's replicas
   (``spanning.spanning_sharding``), from which every class is placed as in
   a restore (``spanning.SpanningArrays``).

A failed device is never read and never takes part: it is left out of the
program's mesh. Source: the reduced TP degree after a failure is Arfeen et
al., arXiv:2504.06095, Sec. 3-4; the cross-host move from DP peers is our own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.program_cache import ProgramCache
from ntp_jax.sharding.topology import holds_mine, is_mine
from ntp_jax.state.peer_supply import piece_sources
from ntp_jax.state.placement import (
  Leaf,
  Path,
  copy_of_replica,
  drop_lead,
  even_pieces_of,
  leaves_of,
  per_device,
  per_device_map,
)
from ntp_jax.state.spanning import SpanningArrays, job_pieces, spanning_sharding

AXIS = "live"


@dataclasses.dataclass(frozen=True)
class Move:
  """One piece to one device: ``piece`` of ``path`` from ``source`` to ``target``."""

  path: Path
  piece: int
  source: Any
  target: Any


def choose_moves(holders: dict[tuple[Path, int], list[Any]],
                 wanted: dict[tuple[Path, int], list[Any]]) -> list[Move]:
  """For every ``(path, piece)`` and device that wants it, the device it comes from.

  Args:
    holders: ``(path, piece) -> live devices holding it`` (old plan, in plan order).
    wanted: ``(path, piece) -> devices of the new plan that need it``.

  Returns:
    One ``Move`` per wanted copy: from the device itself when it holds the piece
    (``source == target``: nothing moves), else from the holder of the same
    process that has sent least so far, else from the least busy holder of another
    process. The same answer in every process (devices only, no data).

  Raises:
    LookupError: some wanted piece has no live holder, naming its path.
  """
  sends: dict[Any, int] = {}
  moves = []
  for key, targets in wanted.items():
    options = holders.get(key, [])
    if not options:
      raise LookupError(f"{'/'.join(key[0])}: no live replica holds piece {key[1]}")
    for target in targets:
      if target in options:
        source = target
      else:
        near = [d for d in options if d.process_index == target.process_index]
        source = min(near or options, key=lambda d: sends.get(d, 0))
        sends[source] = sends.get(source, 0) + 1
      moves.append(Move(key[0], key[1], source, target))
  return moves


def rounds_of(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
  """``(source, target)`` index pairs grouped so that in each round every index sends at
  most once and receives at most once (what one ``ppermute`` carries)."""
  rounds: list[list[tuple[int, int]]] = []
  busy: list[tuple[set[int], set[int]]] = []
  for source, target in pairs:
    free = [i for i, (senders, receivers) in enumerate(busy)
            if source not in senders and target not in receivers]
    if not free:
      rounds.append([])
      busy.append((set(), set()))
    r = free[0] if free else len(rounds) - 1
    rounds[r].append((source, target))
    busy[r][0].add(source)
    busy[r][1].add(target)
  return rounds


def permute_program(cache: ProgramCache, mesh: Mesh,
                    shapes: tuple[tuple[tuple[int, ...], Any], ...],
                    perms: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]):
  """Jitted ``shard_map`` over ``mesh``'s one axis, made once per run in ``cache``: input
  ``i`` is ``[devices, rounds_i, *piece_i]`` of ``shapes[i] = (piece_i, dtype name)``;
  round ``r`` of it is ``ppermute``d by ``perms[i][r]``."""
  return cache.program(("peer permute", mesh, shapes, perms), lambda: _permute_body(mesh, perms))


def _permute_body(mesh: Mesh, perms: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]):
  def body(*xs):
    out = []
    for x, rounds in zip(xs, perms):
      out.append(jnp.stack([jax.lax.ppermute(x[:, r], AXIS, list(perm))
                            for r, perm in enumerate(rounds)], axis=1))
    return tuple(out)

  spec = P(AXIS)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(perms),
                               out_specs=(spec,) * len(perms)))


class CrossProcessPeers(SpanningArrays):
  """The job's logical state spanning the new plan, moved from the live old classes.

  Args:
    programs: the old plan's class programs (abstract where another process holds them).
    dead: devices that failed (never read, not in the program).
    live_devices: every device of the job that is alive (the program's mesh).
    target: the new plan's first class's abstract state (names the logical leaves).
    meshes: the new plan's class meshes, in plan order.
    t_min: the new plan's smallest TP degree.
    cache: where the programs are kept (default: a fresh ``ProgramCache``).

  Attributes:
    copied_bytes: bytes that changed device (every process, the same count).
    crossed_bytes: of those, bytes that changed process.

  Raises:
    LookupError: some piece has no live copy (the caller restores a checkpoint).
  """

  def __init__(self, programs: list, dead: set, live_devices: Sequence[jax.Device],
               target: Any, meshes: Sequence[Mesh], t_min: int,
               cache: ProgramCache | None = None):
    old_t_min = min(p.mesh.devices.shape[1] for p in programs)
    # Every old class can cut k pieces and every new class can hold them.
    super().__init__({}, min(t_min, old_t_min), cache)
    leaves, _, _ = leaves_of(target)
    k = {leaf.path: job_pieces(leaf, self.t_min) for leaf in leaves}
    new_rows = [list(row) for mesh in meshes for row in mesh.devices]
    holders: dict[tuple[Path, int], list[Any]] = {}
    for program in programs:
      old_leaves, _, _ = leaves_of({"params": program.params, "opt_state": program.opt_state})
      for leaf in old_leaves:
        # Piece j is made on slot j from the blocks of these slots: all must be alive.
        made_from = (piece_sources(dataclasses.replace(leaf, k=k[leaf.path]))
                     if leaf.layout is not None else None)
        for row in program.mesh.devices:
          if made_from is None:
            holders.setdefault((leaf.path, 0), []).extend(d for d in row if d not in dead)
            continue
          for j, slots in enumerate(made_from):
            if all(row[i] not in dead for i in slots | {j}):
              holders.setdefault((leaf.path, j), []).append(row[j])
    wanted: dict[tuple[Path, int], list[Any]] = {}
    for leaf in leaves:
      for row in new_rows:
        if leaf.layout is not None:
          for j in range(k[leaf.path]):
            wanted.setdefault((leaf.path, j), []).append(row[j])
        else:
          wanted.setdefault((leaf.path, 0), []).extend(row)
    moves = choose_moves(holders, wanted)
    by_path = {leaf.path: leaf for leaf in leaves}
    pieces = {p: dataclasses.replace(leaf, k=k[p]) for p, leaf in by_path.items()}
    piece_bytes = {p: int(np.prod(leaf.piece_shape)) * leaf.dtype.itemsize
                   for p, leaf in pieces.items()}
    self.copied_bytes = sum(piece_bytes[m.path] for m in moves if m.source != m.target)
    self.crossed_bytes = sum(piece_bytes[m.path] for m in moves
                             if m.source.process_index != m.target.process_index)
    self._moves = moves
    have = self._held_pieces(programs, leaves, k, moves, self.cache)
    received = self._cross(moves, have, by_path, k, list(live_devices), self.cache)
    self._arrays = self._assemble(leaves, k, new_rows, moves, have, received)
    self._paths = set(self._arrays)

  def describe(self) -> str:
    return "live DP peers, across processes"

  @staticmethod
  def _held_pieces(programs, leaves: list[Leaf], k: dict[Path, int], moves: list[Move],
                   cache: ProgramCache) -> dict[tuple[Path, int, Any], jax.Array]:
    """``(path, piece, device) -> buffer`` of every piece this process sends or keeps."""
    sources = {(m.path, m.piece, m.source) for m in moves if is_mine(m.source)}
    have: dict[tuple[Path, int, Any], jax.Array] = {}
    for program in programs:
      if not holds_mine(program.mesh):
        continue
      state = {"params": program.params, "opt_state": program.opt_state}
      split = {leaf.path: k[leaf.path] for leaf in leaves if leaf.layout is not None}
      class_leaves, nodes, moved = even_pieces_of(state, program.mesh, split, cache)
      lifted = {}
      for leaf in class_leaves:
        if leaf.layout is None:
          continue
        by_device = per_device(moved[leaf.path])
        for row in program.mesh.devices:
          for j in range(k[leaf.path]):
            if (leaf.path, j, row[j]) in sources:
              lifted[(leaf.path, j, row[j])] = by_device[row[j]]
      have.update(per_device_map(drop_lead, lifted, cache))
      for leaf, node in zip(class_leaves, nodes):
        if leaf.layout is not None:
          continue
        for r, row in enumerate(program.mesh.devices):
          for device in row:
            if (leaf.path, 0, device) in sources and (leaf.path, 0, device) not in have:
              have[(leaf.path, 0, device)] = copy_of_replica(node, leaf, device, r)
    return have

  @staticmethod
  def _cross(moves: list[Move], have, by_path: dict[Path, Leaf], k: dict[Path, int],
             live: list[jax.Device], cache: ProgramCache
             ) -> dict[tuple[Path, int, Any], jax.Array]:
    """The moves between processes, in one program over ``live``: what this process's
    devices received, ``(path, piece, target) -> buffer``."""
    crossing = [m for m in moves if m.source.process_index != m.target.process_index]
    if not crossing or not holds_mine(live):
      return {}
    index = {d: i for i, d in enumerate(live)}
    paths = list(dict.fromkeys(m.path for m in crossing))
    mesh = Mesh(np.array(live, dtype=object), (AXIS,))
    sharding = NamedSharding(mesh, P(AXIS))
    stack_rounds = cache.program(("stack rounds",),
                                 lambda: jax.jit(lambda parts: jnp.stack(parts)[None]))
    inputs, perms, shapes, schedule = [], [], [], []
    for path in paths:
      leaf = by_path[path]
      piece = dataclasses.replace(leaf, k=k[path]).piece_shape
      mine = [m for m in crossing if m.path == path]
      by_pair = {(index[m.source], index[m.target]): m for m in mine}  # one per pair
      rounds = rounds_of(list(by_pair))
      at = {(r, s): by_pair[(s, t)] for r, pairs in enumerate(rounds) for s, t in pairs}
      blocks = []
      for device in live:
        if not is_mine(device):
          continue
        parts = []
        for r in range(len(rounds)):
          move = at.get((r, index[device]))
          parts.append(have[(path, move.piece, device)] if move is not None
                       else jax.device_put(np.zeros(piece, leaf.dtype), device))
        blocks.append(stack_rounds(parts))  # [1, rounds, *piece] on the parts' device
      inputs.append(jax.make_array_from_single_device_arrays(
          (len(live), len(rounds)) + piece, sharding, blocks))
      perms.append(tuple(tuple(pairs) for pairs in rounds))
      shapes.append((piece, np.dtype(leaf.dtype).name))
      schedule.append((path, rounds, by_pair))
    outputs = permute_program(cache, mesh, tuple(shapes), tuple(perms))(*inputs)
    received = {}
    for (path, rounds, by_pair), out in zip(schedule, outputs):
      by_device = per_device(out)
      for r, pairs in enumerate(rounds):
        for s, t in pairs:
          target = live[t]
          if is_mine(target):
            move = by_pair[(s, t)]
            received[(path, move.piece, target)] = by_device[target][0, r]
    return received

  @staticmethod
  def _assemble(leaves: list[Leaf], k: dict[Path, int], new_rows, moves: list[Move], have,
                received) -> dict[Path, jax.Array]:
    """Every leaf as one array spanning the new plan's replicas (``spanning_sharding``)."""
    local: dict[Path, list[jax.Array]] = {leaf.path: [] for leaf in leaves}
    for move in moves:
      if not is_mine(move.target):
        continue
      key = (move.path, move.piece, move.target)
      if move.source == move.target:
        piece = have[key]
      elif is_mine(move.source):
        piece = jax.device_put(have[(move.path, move.piece, move.source)], move.target)
      else:
        piece = received[key]
      local[move.path].append(piece)
    return {leaf.path: jax.make_array_from_single_device_arrays(
        leaf.shape, spanning_sharding(leaf, new_rows, k[leaf.path]), local[leaf.path],
        dtype=leaf.dtype) for leaf in leaves}

