"""Live recovery across processes: the new plan's state from DP peers on other hosts.

In one process ``peer_move.PeerMove`` moves units with ``jax.device_put``;
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

The schedule and every program of the move are decided from metadata (the old
classes' shapes and shardings, the dead devices, the new plan), so the same
moves can be lowered ahead of a failure (``CrossProcessPeers.lower``) and then
run without compiling (``CrossProcessPeers.move``).

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
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.program_cache import ProgramCache
from ntp_jax.sharding.collectives import transfer_schedule
from ntp_jax.sharding.layout import owner_layout
from ntp_jax.sharding.topology import holds_mine, is_mine
from ntp_jax.state.placement import (
  EvenPieces,
  Leaf,
  Path,
  PerDeviceMap,
  drop_lead,
  leaves_of,
  per_device,
)
from ntp_jax.state.spanning import SpanningArrays, job_pieces, spanning_sharding

AXIS = "live"


def piece_sources(leaf: Leaf) -> list[set[int]]:
  """For each even piece ``j`` of a split ``leaf`` (``leaf.pieces`` of them): the live-slot
  positions whose blocks it is made from."""
  sources: list[set[int]] = [set() for _ in range(leaf.pieces)]
  for t in transfer_schedule(owner_layout(leaf.layout), leaf.even_layout):
    for i, length in enumerate(t["send_len"]):
      if length > 0:
        sources[i + t["shift"]].add(i)
  return sources


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


def first_row(x: jax.Array) -> jax.Array:
  """A replica-stacked leaf's ``[1, *shape]`` buffer on one device, as ``shape``."""
  return x[0]


def fresh_copy(x: jax.Array) -> jax.Array:
  """A copy of a bare leaf's buffer (the old step would donate the original)."""
  return jnp.copy(x)


def stack_rounds(parts: list[jax.Array]) -> jax.Array:
  """One device's pieces of one leaf, one per round, as ``[1, rounds, *piece]``."""
  return jnp.stack(parts)[None]


def unstack_rounds(x: jax.Array) -> list[jax.Array]:
  """``[1, rounds, *piece]`` back to one piece per round."""
  return [x[0, r] for r in range(x.shape[1])]


def _on(device: jax.Device, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=SingleDeviceSharding(device))


class _HeldPieces:
  """The pieces this process's devices send or keep, cut from the old classes it holds:
  each class's split leaves moved to their even pieces (``placement.EvenPieces``), then
  every piece (and every unsplit leaf's copy) taken off its block, one program per device.

  Built from shapes and shardings only; calling it reads the old state and returns
  ``(path, piece, device) -> buffer``.
  """

  def __init__(self, programs: list, leaves: list[Leaf], k: dict[Path, int],
               moves: list[Move], cache: ProgramCache):
    sources = {(m.path, m.piece, m.source) for m in moves if is_mine(m.source)}
    split = {leaf.path: k[leaf.path] for leaf in leaves if leaf.layout is not None}
    self._cuts: list[EvenPieces] = []
    self._split_keys: dict[tuple, tuple[int, Path, Any]] = {}  # key -> (cut, path, device)
    self._unsplit_keys: dict[tuple, tuple[Any, Any]] = {}  # key -> (value, device)
    lift, rows, copies = {}, {}, {}
    for program in programs:
      if not holds_mine(program.mesh):
        continue
      cut = EvenPieces({"params": program.params, "opt_state": program.opt_state},
                       program.mesh, split, cache)
      self._cuts.append(cut)
      for leaf, node in zip(cut.leaves, cut.nodes):
        if leaf.layout is not None:
          for row in program.mesh.devices:
            for j in range(leaf.pieces):
              key = (leaf.path, j, row[j])
              if key in sources:
                lift[key] = _on(row[j], (1, 1) + leaf.piece_shape, leaf.dtype)
                self._split_keys[key] = (len(self._cuts) - 1, leaf.path, row[j])
          continue
        value = node.get_value() if leaf.stacked else node
        shard = value.sharding.shard_shape(value.shape)  # [1, *shape] when stacked
        for row in program.mesh.devices:
          for device in row:
            key = (leaf.path, 0, device)
            if key in sources and key not in self._unsplit_keys:
              (rows if leaf.stacked else copies)[key] = _on(device, shard, value.dtype)
              self._unsplit_keys[key] = (value, device)
    self._lift = PerDeviceMap(drop_lead, lift, cache)
    self._rows = PerDeviceMap(first_row, rows, cache)
    self._copies = PerDeviceMap(fresh_copy, copies, cache)

  def lower(self) -> list[jax.stages.Lowered]:
    return [lowered for op in (*self._cuts, self._lift, self._rows, self._copies)
            for lowered in op.lower()]

  def __call__(self) -> dict[tuple[Path, int, Any], jax.Array]:
    moved = [cut() for cut in self._cuts]
    by_device: dict[tuple[int, Path], dict] = {}
    lifted = {}
    for key, (cut, path, device) in self._split_keys.items():
      if (cut, path) not in by_device:
        by_device[(cut, path)] = per_device(moved[cut][path])
      lifted[key] = by_device[(cut, path)][device]
    have = self._lift(lifted)
    unsplit = {key: per_device(value)[device]
               for key, (value, device) in self._unsplit_keys.items()}
    have.update(self._rows({key: unsplit[key] for key in self._rows.keys}))
    have.update(self._copies({key: unsplit[key] for key in self._copies.keys}))
    return have


class _Crossing:
  """The moves between processes: one ``ppermute`` program over the live devices, with one
  program per device stacking each leaf's pieces by round before it and one taking them
  apart after. Built from the schedule only; calling it with the held pieces returns what
  this process's devices received, ``(path, piece, target) -> buffer``."""

  def __init__(self, moves: list[Move], pieces: dict[Path, Leaf], live: list[jax.Device],
               cache: ProgramCache):
    crossing = [m for m in moves if m.source.process_index != m.target.process_index]
    self.active = bool(crossing) and holds_mine(live)
    if not self.active:
      return
    index = {d: i for i, d in enumerate(live)}
    self._live = live
    mesh = Mesh(np.array(live, dtype=object), (AXIS,))
    self._sharding = NamedSharding(mesh, P(AXIS))
    self._schedule = []  # (path, rounds, by_pair)
    self._parts: dict[tuple[Path, Any], list] = {}  # (path, device) -> held key or None per round
    self._zeros: dict[Path, tuple[tuple[int, ...], Any]] = {}
    stacks, received, self._inputs, perms, shapes = {}, {}, [], [], []
    for path in dict.fromkeys(m.path for m in crossing):
      leaf = pieces[path]
      piece = leaf.piece_shape
      by_pair = {(index[m.source], index[m.target]): m for m in crossing if m.path == path}
      rounds = rounds_of(list(by_pair))
      at = {(r, s): by_pair[(s, t)] for r, pairs in enumerate(rounds) for s, t in pairs}
      receivers = {t for pairs in rounds for _, t in pairs}
      for device in live:
        if not is_mine(device):
          continue
        moves_out = [at.get((r, index[device])) for r in range(len(rounds))]
        self._parts[(path, device)] = [None if m is None else (path, m.piece, device)
                                       for m in moves_out]
        stacks[(path, device)] = [_on(device, piece, leaf.dtype)] * len(rounds)
        if index[device] in receivers:
          received[(path, device)] = _on(device, (1, len(rounds)) + piece, leaf.dtype)
      self._zeros[path] = (piece, leaf.dtype)
      self._inputs.append(jax.ShapeDtypeStruct((len(live), len(rounds)) + piece, leaf.dtype,
                                               sharding=self._sharding))
      perms.append(tuple(tuple(pairs) for pairs in rounds))
      shapes.append((piece, np.dtype(leaf.dtype).name))
      self._schedule.append((path, rounds, by_pair))
    self._stack = PerDeviceMap(stack_rounds, stacks, cache)
    self._permute = permute_program(cache, mesh, tuple(shapes), tuple(perms))
    self._unstack = PerDeviceMap(unstack_rounds, received, cache)

  def lower(self) -> list[jax.stages.Lowered]:
    if not self.active:
      return []
    return [*self._stack.lower(), self._permute.lower(*self._inputs), *self._unstack.lower()]

  def __call__(self, have: dict[tuple[Path, int, Any], jax.Array]
               ) -> dict[tuple[Path, int, Any], jax.Array]:
    if not self.active:
      return {}
    parts = {}
    for (path, device), keys in self._parts.items():
      shape, dtype = self._zeros[path]
      # A round this device sends nothing in: zeros from the host (no program).
      parts[(path, device)] = [have[key] if key is not None
                               else jax.device_put(np.zeros(shape, dtype), device)
                               for key in keys]
    stacked = self._stack(parts)  # (path, device) -> [1, rounds, *piece]
    inputs = [jax.make_array_from_single_device_arrays(
        spec.shape, self._sharding, [stacked[(path, d)] for d in self._live if is_mine(d)])
        for (path, _, _), spec in zip(self._schedule, self._inputs)]
    outputs = self._permute(*inputs)
    by_device = {}
    for (path, _, _), out in zip(self._schedule, outputs):
      shards = per_device(out)
      by_device.update({(path, d): shards[d] for p, d in self._unstack.keys if p == path})
    taken = self._unstack(by_device)  # (path, device) -> one piece per round
    received = {}
    for path, rounds, by_pair in self._schedule:
      for r, pairs in enumerate(rounds):
        for s, t in pairs:
          target = self._live[t]
          if is_mine(target):
            received[(path, by_pair[(s, t)].piece, target)] = taken[(path, target)][r]
    return received


class CrossProcessPeers(SpanningArrays):
  """The job's logical state spanning the new plan, moved from the live old classes.

  Construction plans the moves and makes their programs from metadata only; ``move()``
  runs them (every live process must call it: the moves between processes are one
  collective), ``lower()`` lowers them for compiling ahead.

  Args:
    programs: the old plan's class programs (abstract where another process holds them;
      abstract everywhere when only lowering).
    dead: devices that failed (never read, not in the program).
    live_devices: every device of the job that is alive (the program's mesh).
    target: the new plan's first class's abstract state (names the logical leaves).
    meshes: the new plan's class meshes, in plan order.
    t_min: the new plan's smallest TP degree.
    cache: where the programs are kept (default: a fresh ``ProgramCache``).

  Attributes:
    copied_bytes: bytes that change device (every process, the same count).
    crossed_bytes: of those, bytes that change process.

  Raises:
    LookupError: some piece has no live copy (the caller restores a checkpoint).
  """

  def __init__(self, programs: list, dead: set, live_devices: Sequence[jax.Device],
               target: Any, meshes: Sequence[Mesh], t_min: int,
               cache: ProgramCache | None = None):
    if not programs:
      raise LookupError("no replica of the old plan is left on the live processes")
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
    pieces = {leaf.path: dataclasses.replace(leaf, k=k[leaf.path]) for leaf in leaves}
    piece_bytes = {p: int(np.prod(leaf.piece_shape)) * leaf.dtype.itemsize
                   for p, leaf in pieces.items()}
    self.copied_bytes = sum(piece_bytes[m.path] for m in moves if m.source != m.target)
    self.crossed_bytes = sum(piece_bytes[m.path] for m in moves
                             if m.source.process_index != m.target.process_index)
    self._moves, self._leaves = moves, leaves
    self._paths = set(pieces)
    self._spans = {leaf.path: leaf.abstract(spanning_sharding(leaf, new_rows, k[leaf.path]))
                   for leaf in leaves}
    self._held = _HeldPieces(programs, leaves, k, moves, self.cache)
    self._crossing = _Crossing(moves, pieces, list(live_devices), self.cache)
    self._moved = False

  def describe(self) -> str:
    return "live DP peers, across processes"

  def lower(self) -> list[jax.stages.Lowered]:
    """The move's programs, lowered for the old state's shapes and shardings (nothing read):
    once compiled, ``move`` and the new plan's placement from it compile nothing."""
    return self._held.lower() + self._crossing.lower()

  def move(self) -> CrossProcessPeers:
    """Run the moves (once): this process's devices then hold their pieces of the new plan."""
    if not self._moved:
      have = self._held()
      received = self._crossing(have)
      self._arrays = self._assemble(have, received)
      self._moved = True
    return self

  def spanning_spec(self, path: Path) -> jax.ShapeDtypeStruct:
    return self._spans[path]

  def _assemble(self, have, received) -> dict[Path, jax.Array]:
    """Every leaf as one array spanning the new plan's replicas (``spanning_sharding``)."""
    local: dict[Path, list[jax.Array]] = {leaf.path: [] for leaf in self._leaves}
    for move in self._moves:
      if not is_mine(move.target):
        continue
      key = (move.path, move.piece, move.target)
      if move.source == move.target:
        piece = have[key]
      elif is_mine(move.source):  # within this process: a copy between devices, no program
        piece = jax.device_put(have[(move.path, move.piece, move.source)], move.target)
      else:
        piece = received[key]
      local[move.path].append(piece)
    return {leaf.path: jax.make_array_from_single_device_arrays(
        leaf.shape, self._spans[leaf.path].sharding, local[leaf.path], dtype=leaf.dtype)
        for leaf in self._leaves}
