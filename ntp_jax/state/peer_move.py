"""Live recovery in one process: a new class's state from the old plan's live devices, moving
only the shard units whose device changes.

For every device of the new class and every leaf of its state, the new block is worked out
from the two layouts (``held_runs``, the runs of ``Layout.gather_index``): each logical
element it holds comes from the device itself when the old plan kept it there, else from a
live old device that holds it (the one with the fewest bytes to send so far); the padding
is zeros, made where it lies. Then

1. per sending device, one program packs everything it sends to one device into one flat
   buffer per dtype;
2. ``jax.device_put`` carries the buffers: the bytes that must move and no others (no
   padding, no unit already in place, nothing of a healthy replica whose blocks stay);
3. per receiving device, one program cuts the buffers and its own old blocks into the new
   blocks. A buffer whose new block equals the old one is handed over as it is (no program).

Everything is decided from metadata (the old classes' leaves, meshes and layouts, the dead
devices, the new class's leaves and mesh), so the programs lower ahead of a failure
(``PeerMove.lower``) from the caller's ``ProgramCache``, and the move then compiles nothing.
A dead device is never read. Source: the reduced TP degree after a failure is Arfeen et al.,
arXiv:2504.06095, Sec. 3-4; the live move from DP peers is our own.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.program_cache import ProgramCache
from ntp_jax.sharding.layout import Layout
from ntp_jax.sharding.mesh import DP, TP
from ntp_jax.state.placement import Leaf, Path, block_shape

Run = tuple[int, int, int]  # logical [start, stop) along the split axis, held from block position
ZERO, LOCAL, RECEIVED = 0, 1, 2  # where a part of a new block comes from
AXIS = "live"  # the collective's one mesh axis: every live device of the job


def held_runs(layout: Layout, position: int) -> tuple[Run, ...]:
  """The logical runs that live slot ``position`` of ``layout`` holds, in elements: its own run
  from block position 0, and the shared units (if any) after the own region
  (``Layout.gather_index``'s entries, as runs)."""
  runs = []
  size = layout.sizes[position]
  if size:
    runs.append((layout.offsets[position], layout.offsets[position] + size, 0))
  if layout.shared_units:
    runs.append((sum(layout.sizes), layout.size, layout.own_size))
  return tuple(runs)


def buffer_shape(leaf: Leaf) -> tuple[int, ...]:
  """One device's buffer of ``leaf`` in a class state: ``[1, 1, *block]`` for a split leaf,
  ``[1, *shape]`` for a replica-stacked one, the whole array for a bare one."""
  if leaf.layout is not None:
    return (1, 1) + block_shape(leaf)
  return (1,) + leaf.shape if leaf.stacked else leaf.shape


def _same_leaf(old: Leaf, new: Leaf) -> bool:
  """An old buffer can supply the new leaf: the same logical array, split on the same axis."""
  return (old.shape == new.shape and old.stacked == new.stacked and old.axis == new.axis
          and (old.layout is None) == (new.layout is None))


@dataclasses.dataclass(frozen=True)
class Holding:
  """A live old device's buffer of one leaf.

  Attributes:
    source: the old class it belongs to (index). device: where it lives.
    leaf: the old class's leaf. runs: the logical runs in its block (split leaves).
    order: ties between sources go to the lowest.
  """

  source: int
  device: Any
  leaf: Leaf
  runs: tuple[Run, ...]
  order: int


@dataclasses.dataclass(frozen=True)
class Part:
  """``length`` elements of a new block along its split axis, from block position ``at``:
  zeros (``device`` None), or the block of ``device`` (this one's own, or another's) from
  position ``start``. An unsplit leaf is one part of ``length`` 1."""

  at: int
  length: int
  device: Any = None
  start: int = 0


@dataclasses.dataclass(frozen=True)
class BlockPlan:
  """How one device's buffer of one new leaf is made.

  Attributes:
    path, device: which buffer. leaf: the new leaf.
    kept: the old buffer on ``device`` is the new one as it is (no program, no copy).
    source: the old class whose buffers the parts read (every holder of a path on one device
      belongs to one class). parts: in block order, covering the block (unsplit: one part).
  """

  path: Path
  device: Any
  leaf: Leaf
  kept: Holding | None
  parts: tuple[Part, ...]
  sources: tuple[tuple[Any, int], ...]  # (device, old class) of every non-zero part's buffer


def plan_blocks(old: Sequence[tuple[Mesh | np.ndarray, dict[Path, Leaf]]], dead: Collection[Any],
                classes: Sequence[tuple[Sequence[Leaf], np.ndarray]],
                near: Callable[[Any, Any], bool] | None = None) -> list[BlockPlan]:
  """Where every element of the new classes' buffers comes from (metadata only; nothing read).

  Args:
    old: per old class, its ``[replicas, degree]`` device grid (or mesh) and ``path -> Leaf``.
    dead: failed devices (never a source).
    classes: per new class, its leaves (``placement.leaves_of`` of its abstract state) and
      its ``[replicas, degree]`` device grid.
    near: ``(holder, device) -> bool``: holders near the device go first (the same process).

  Returns:
    One ``BlockPlan`` per new device and leaf, classes and devices in grid order. An element
    the device held on the old plan stays (a ``LOCAL`` part); the others come from a live
    holder, near ones first, then the one with the fewest bytes to send so far, ties to the
    lowest ``Holding.order``. The same answer wherever it is computed.

  Raises:
    LookupError: some element has no live holder (then the caller restores a checkpoint),
      naming the leaf.
  """
  holdings: dict[Path, dict[Any, Holding]] = {}
  order = 0
  for source, (grid, by_path) in enumerate(old):
    grid = np.asarray(getattr(grid, "devices", grid))
    for row in grid:
      for position, device in enumerate(row):
        if device in dead:
          continue
        for path, leaf in by_path.items():
          runs = held_runs(leaf.layout, position) if leaf.layout is not None else ()
          holdings.setdefault(path, {})[device] = Holding(source, device, leaf, runs, order)
          order += 1
  load: dict[Any, int] = {}
  plans = []
  for leaves, devices in classes:
    for row in np.asarray(getattr(devices, "devices", devices)):
      for position, device in enumerate(row):
        for leaf in leaves:
          candidates = [h for h in holdings.get(leaf.path, {}).values()
                        if _same_leaf(h.leaf, leaf)]
          plans.append(_plan_block(leaf, position, device, candidates, load, near))
  return plans


def _plan_block(leaf: Leaf, position: int, device: Any, candidates: list[Holding],
                load: dict[Any, int], near: Callable[[Any, Any], bool] | None) -> BlockPlan:
  own = next((h for h in candidates if h.device == device), None)
  others = sorted((h for h in candidates if h.device != device), key=lambda h: h.order)

  def rank(holder):
    far = near is not None and not near(holder.device, device)
    return (far, load.get(holder.device, 0), holder.order)

  if leaf.layout is None:
    if own is not None and own.leaf.dtype == leaf.dtype:
      return BlockPlan(leaf.path, device, leaf, own, (), ())
    source = own or min(others, key=rank, default=None)
    if source is None:
      raise LookupError(f"{leaf.name}: no live device holds it")
    if source is not own:
      load[source.device] = load.get(source.device, 0) + leaf.nbytes
    return BlockPlan(leaf.path, device, leaf, None, (Part(0, 1, source.device),),
                     ((source.device, source.source),))
  runs = held_runs(leaf.layout, position)
  if (own is not None and own.runs == runs and own.leaf.layout.block == leaf.layout.block
      and own.leaf.dtype == leaf.dtype):
    return BlockPlan(leaf.path, device, leaf, own, (), ())
  row_bytes = leaf.nbytes // leaf.shape[leaf.axis]
  parts: list[Part] = []
  mine = own.runs if own is not None else ()
  for lo, hi, at in runs:
    a = lo
    while a < hi:
      here = next((run for run in mine if run[0] <= a < run[1]), None)
      if here is not None:  # held here already: it stays
        end = min(hi, here[1])
        parts.append(Part(at + a - lo, end - a, device, here[2] + a - here[0]))
        a = end
        continue
      # Up to the next element held here, from the least-loaded live holder.
      stop = min([hi] + [run[0] for run in mine if a < run[0] < hi])
      holders = [(h, run) for h in others for run in h.runs if run[0] <= a < run[1]]
      if not holders:
        raise LookupError(f"{leaf.name}: no live device holds elements {a}..{stop - 1} of "
                          f"axis {leaf.axis}")
      holder, (start, stop_run, pos) = min(holders, key=lambda hr: rank(hr[0]))
      end = min(stop, stop_run)
      parts.append(Part(at + a - lo, end - a, holder.device, pos + a - start))
      load[holder.device] = load.get(holder.device, 0) + (end - a) * row_bytes
      a = end
  parts.sort(key=lambda part: part.at)
  filled, at = [], 0
  for part in parts:  # the padding between and after the runs: zeros
    if part.at > at:
      filled.append(Part(at, part.at - at))
    filled.append(part)
    at = part.at + part.length
  if at < leaf.layout.block:
    filled.append(Part(at, leaf.layout.block - at))
  by_device = {h.device: h.source for h in candidates}
  sources = tuple(dict.fromkeys((p.device, by_device[p.device]) for p in filled
                                if p.device is not None))
  return BlockPlan(leaf.path, device, leaf, None, tuple(filled), sources)


# -- the programs (module level: a recipe is all they depend on, and it keys the cache) ------

def _pack(recipe, buffers):
  """One sending device: per flat output, its items (input, axis, start, length) cut from the
  buffers and laid end to end (``axis`` -1: the whole buffer); per round of the collective,
  ``[1, length]``: its items padded with zeros (none: zeros)."""
  _, flats, rounds = recipe
  out = []
  for items in flats:
    out.append(_cut(buffers, items))
  for dtype, length, items in rounds:
    row = _cut(buffers, items) if items else jnp.zeros((0,), dtype)
    out.append(jnp.pad(row, (0, length - row.shape[0]))[None])
  return out


def _cut(buffers, items):
  parts = []
  for index, axis, start, length in items:
    x = buffers[index]
    if axis >= 0:
      x = jax.lax.slice_in_dim(x[0, 0], start, start + length, axis=axis)
    parts.append(x.reshape(-1))
  return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _unpack(recipe, own, received):
  """One receiving device: every new buffer from its parts (zeros, its own old blocks, the
  received flat buffers)."""
  _, _, outputs = recipe
  received = [x.reshape(-1) for x in received]  # a collective's round arrives as [1, length]
  result = []
  for shape, dtype, axis, parts in outputs:
    if axis < 0:  # an unsplit leaf: one buffer, whole (its own, cast; or received)
      (kind, index, start, _), = parts
      whole = (own[index] if kind == LOCAL
               else received[index][start:start + int(np.prod(shape))].reshape(shape))
      result.append(whole.astype(dtype))
      continue
    block = shape[2:]
    pieces = []
    for kind, index, start, length in parts:
      piece_shape = block[:axis] + (length,) + block[axis + 1:]
      if kind == ZERO:
        piece = jnp.zeros(piece_shape, dtype)
      elif kind == LOCAL:
        piece = jax.lax.slice_in_dim(own[index][0, 0], start, start + length, axis=axis)
      else:
        size = int(np.prod(piece_shape))
        piece = received[index][start:start + size].reshape(piece_shape)
      pieces.append(piece.astype(dtype))
    whole = jnp.concatenate(pieces, axis=axis) if len(pieces) > 1 else pieces[0]
    result.append(whole[None, None])
  return result


def _permute_body(mesh: Mesh, perms: tuple[tuple[tuple[int, int], ...], ...]):
  def body(*rounds):
    return tuple(jax.lax.ppermute(x, AXIS, list(perm)) for x, perm in zip(rounds, perms))

  spec = P(AXIS)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(perms),
                               out_specs=(spec,) * len(perms)))


def _program(cache: ProgramCache, kind: str, fn: Callable, recipe: Any,
             device: Any = None) -> Any:
  """The jitted ``fn`` of ``recipe``; with ``device`` (a program without inputs, which would
  otherwise run on the default device) its results are made there."""
  if device is None:
    return cache.program(("peer move", kind, recipe),
                         lambda: jax.jit(functools.partial(fn, recipe)))
  return cache.program(("peer move", kind, recipe, device), lambda: jax.jit(
      functools.partial(fn, recipe), out_shardings=SingleDeviceSharding(device)))


def _spec(shape, dtype, device) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=SingleDeviceSharding(device))


def _mine(device) -> bool:
  return getattr(device, "process_index", 0) == jax.process_index()


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


class PeerMove:
  """The new classes' state from the old plan's live devices: the plan (``plan_blocks``) and its
  programs, made from metadata at construction.

  In one process the buffers travel by ``jax.device_put``. With ``live`` (a multi-process
  job) the buffers between processes travel in one ``shard_map`` program over the live
  devices, a ``jax.lax.ppermute`` per round and dtype (in a round each device sends and
  receives at most one buffer, padded to the round's longest); every live process must run
  the move, and each makes only its own devices' buffers.

  Args:
    old: per old class, its mesh (or device grid) and ``path -> Leaf``.
    dead: failed devices. classes: per new class, its leaves and mesh.
    read: ``(old class, path) -> {device: buffer}``, the old state's buffers on this
      process's devices (asked only when the move runs).
    cache: where the programs are kept (default: a fresh ``ProgramCache``).
    live: every live device of the job, in order (a multi-process job); None: one process.

  Attributes:
    missing: why some element has no live holder (then ``lower`` gives None and the call
      raises), else None.
    copied_bytes: bytes that change device (every process, the same count).
    crossed_bytes: of those, bytes that change process. wire_bytes: what the collective
      carries between processes, padding included.
    ran: the move has run. seconds: how long it took, until its arrays were ready.

  ``run()`` runs the move and returns, per new class, ``path -> jax.Array`` in the class
  sharding (blocks ``P('dp', 'tp')``, replica-stacked ``P('dp')``, bare ``P()``; None for a
  class with no device in this process); ``lower`` lowers the same programs.
  """

  def __init__(self, old: Sequence[tuple[Any, dict[Path, Leaf]]], dead: Collection[Any],
               classes: Sequence[tuple[Sequence[Leaf], Mesh]],
               read: Callable[[int, Path], dict[Any, jax.Array]],
               cache: ProgramCache | None = None, live: Sequence[Any] | None = None):
    self.classes = [(list(leaves), mesh) for leaves, mesh in classes]
    self._read, self._live = read, list(live) if live is not None else None
    self.missing: str | None = None
    self.copied_bytes = self.crossed_bytes = self.wire_bytes = 0
    self.ran = False
    self.seconds = 0.0
    self._result: list | None = None
    near = None if live is None else (lambda a, b: a.process_index == b.process_index)
    try:
      self._plans = plan_blocks(old, dead, [(leaves, mesh.devices) for leaves, mesh in
                                            self.classes], near)
    except LookupError as error:
      self.missing, self._plans = str(error), []
      return
    old_leaves = {(source, path): leaf for source, (_, by_path) in enumerate(old)
                  for path, leaf in by_path.items()}
    self._cache = cache or ProgramCache()
    self._make(old_leaves, self._cache)

  def _make(self, old_leaves: dict[tuple[int, Path], Leaf], cache: ProgramCache) -> None:
    # Every flat buffer of the move, (sender, receiver, dtype) -> items; computed in full in
    # every process (the collective's schedule must agree), programs made for own devices.
    flats: dict[tuple[Any, Any, str], list] = {}
    inputs: dict[Any, dict[tuple[int, Path], int]] = {}
    where: dict[tuple[Path, Any, int], tuple[tuple[Any, Any, str], int]] = {}
    sizes: dict[tuple[Any, Any, str], int] = {}
    for plan in self._plans:
      sources = dict(plan.sources)
      for n, part in enumerate(plan.parts):
        if part.device is None or part.device == plan.device:
          continue
        key = (sources[part.device], plan.path)
        old = old_leaves[key]
        flat = (part.device, plan.device, str(old.dtype))
        index = inputs.setdefault(part.device, {}).setdefault(key, len(inputs[part.device]))
        if old.layout is None:
          item, count = (index, -1, 0, 0), int(np.prod(buffer_shape(old)))
        else:
          row = int(np.prod(old.shape)) // old.shape[old.axis]
          item, count = (index, old.axis, part.start, part.length), part.length * row
        where[(plan.path, plan.device, n)] = (flat, sizes.get(flat, 0))
        sizes[flat] = sizes.get(flat, 0) + count
        flats.setdefault(flat, []).append(item)
        self.copied_bytes += count * old.dtype.itemsize
        if not _near(part.device, plan.device):
          self.crossed_bytes += count * old.dtype.itemsize
    self._make_rounds(flats, sizes)
    self._make_packs(flats, inputs, old_leaves, cache)
    self._make_unpacks(where, sizes, old_leaves, cache)

  def _make_rounds(self, flats, sizes) -> None:
    """The collective: per dtype, the crossing buffers in rounds (each device sends and
    receives at most once a round), each round one array of its longest buffer."""
    self._rounds: list[tuple[str, int, dict]] = []  # (dtype, length, {(sender, receiver): flat})
    self._round_of: dict[tuple[Any, Any, str], int] = {}
    crossing = [f for f in flats if not _near(f[0], f[1])]
    if not crossing or self._live is None:
      self._permute = None
      return
    index = {d: i for i, d in enumerate(self._live)}
    for dtype in sorted({f[2] for f in crossing}):
      pairs = {(index[s], index[r]): (s, r, dt) for s, r, dt in crossing if dt == dtype}
      for pairs_in_round in rounds_of(sorted(pairs)):
        members = {pair: pairs[pair] for pair in pairs_in_round}
        length = max(sizes[f] for f in members.values())
        for flat in members.values():
          self._round_of[flat] = len(self._rounds)
        self._rounds.append((dtype, length, members))
        self.wire_bytes += length * len(members) * np.dtype(dtype).itemsize
    mesh = Mesh(np.array(self._live, dtype=object), (AXIS,))
    self._sharding = NamedSharding(mesh, P(AXIS))
    perms = tuple(tuple(sorted(members)) for _, _, members in self._rounds)
    self._permute = self._cache.program(("peer move permute", mesh, perms),
                                        lambda: _permute_body(mesh, perms))
    self._round_specs = [jax.ShapeDtypeStruct((len(self._live), length), np.dtype(dtype),
                                              sharding=self._sharding)
                         for dtype, length, _ in self._rounds]

  def _make_packs(self, flats, inputs, old_leaves, cache) -> None:
    """Per sending device of this process, one program: its flats to devices of its own
    process, and its buffer of every round of the collective."""
    self._packs = []  # (device, program, input keys, flat keys, specs)
    senders = set(inputs) | ({d for d in self._live} if self._permute is not None else set())
    order = self._live or list(dict.fromkeys(f[0] for f in flats))
    for device in [d for d in order if d in senders and _mine(d)]:
      keys = list(inputs.get(device, {}))
      specs = [_spec(buffer_shape(old_leaves[k]), old_leaves[k].dtype, device) for k in keys]
      near = [f for f in flats if f[0] == device and _near(device, f[1])]
      rounds = []
      for dtype, length, members in self._rounds:
        flat = next((f for f in members.values() if f[0] == device), None)
        rounds.append((dtype, length, tuple(flats[flat]) if flat else ()))
      recipe = (tuple((s.shape, str(s.dtype)) for s in specs),
                tuple(tuple(flats[f]) for f in near), tuple(rounds))
      program = _program(cache, "pack", _pack, recipe, None if keys else device)
      self._packs.append((device, program, keys, near, specs))

  def _make_unpacks(self, where, sizes, old_leaves, cache) -> None:
    """Per receiving device of this process, one program making its new buffers (those that
    change: a block that does not is handed over as it is)."""
    self._unpacks = []  # (device, program, own keys, received keys, output keys, specs)
    by_device: dict[Any, list[BlockPlan]] = {}
    for plan in self._plans:
      if plan.kept is None and _mine(plan.device):
        by_device.setdefault(plan.device, []).append(plan)
    for device, plans in by_device.items():
      own: dict[tuple[int, Path], int] = {}
      received: list = []  # a flat key (within the process) or ("round", r)
      outputs = []
      for plan in plans:
        sources = dict(plan.sources)
        parts = []
        for n, part in enumerate(plan.parts):
          if part.device is None:
            parts.append((ZERO, 0, 0, part.length))
          elif part.device == device:
            index = own.setdefault((sources[device], plan.path), len(own))
            parts.append((LOCAL, index, part.start, part.length))
          else:
            flat, offset = where[(plan.path, device, n)]
            key = flat if _near(flat[0], device) else ("round", self._round_of[flat])
            if key not in received:
              received.append(key)
            parts.append((RECEIVED, received.index(key), offset, part.length))
        leaf = plan.leaf
        axis = leaf.axis if leaf.layout is not None else -1
        outputs.append((buffer_shape(leaf), str(leaf.dtype), axis, tuple(parts)))
      own_specs = [_spec(buffer_shape(old_leaves[k]), old_leaves[k].dtype, device) for k in own]
      received_specs = [
          _spec((1, self._rounds[k[1]][1]), self._rounds[k[1]][0], device) if k[0] == "round"
          else _spec((sizes[k],), k[2], device) for k in received]
      recipe = (tuple((s.shape, str(s.dtype)) for s in own_specs),
                tuple((s.shape, str(s.dtype)) for s in received_specs), tuple(outputs))
      program = _program(cache, "unpack", _unpack, recipe,
                         None if own or received else device)
      self._unpacks.append((device, program, list(own), received,
                            [(p.path, device) for p in plans], own_specs + received_specs))

  def lower(self) -> list[jax.stages.Lowered] | None:
    """The move's programs lowered for the buffers they will meet (nothing read); None when
    some element has no live holder (that recovery restores a checkpoint)."""
    if self.missing is not None:
      return None
    lowered = [program.lower(specs) for _, program, _, _, specs in self._packs]
    if self._permute is not None and any(_mine(d) for d in self._live):
      lowered.append(self._permute.lower(*self._round_specs))
    for _, program, own, _, _, specs in self._unpacks:
      lowered.append(program.lower(specs[:len(own)], specs[len(own):]))
    return lowered

  def run(self) -> list[dict[Path, jax.Array] | None]:
    """Run the move (once): per new class, its arrays (None: no device here).

    Raises:
      LookupError: some element has no live holder (``missing``).
    """
    if self.missing is not None:
      raise LookupError(self.missing)
    if self._result is None:
      start = time.perf_counter()
      self._result = self._run()
      jax.block_until_ready([r for r in self._result if r is not None])
      self.seconds = time.perf_counter() - start
      self.ran = True
    return self._result

  def _run(self) -> list[dict[Path, jax.Array] | None]:
    buffers: dict[tuple[int, Path], dict[Any, jax.Array]] = {}

    def buffer(key, device):
      if key not in buffers:
        buffers[key] = self._read(*key)
      x = buffers[key][device]
      # A one-device class's buffer may carry its class sharding: the programs were lowered
      # for a single-device one (the same buffer, relabelled; nothing is copied).
      return (x if isinstance(x.sharding, SingleDeviceSharding)
              else jax.device_put(x, SingleDeviceSharding(device)))

    sent, rounds = [], {}
    for device, program, keys, near, _ in self._packs:
      out = program([buffer(k, device) for k in keys])
      sent += zip(near, out[:len(near)])
      for r, x in enumerate(out[len(near):]):
        rounds.setdefault(r, []).append(x)
    arrived: dict[Any, jax.Array] = dict(zip(
        [k for k, _ in sent], jax.device_put([x for _, x in sent], [k[1] for k, _ in sent])))
    if self._permute is not None and rounds:
      inputs = [jax.make_array_from_single_device_arrays(spec.shape, self._sharding, rounds[r])
                for r, spec in enumerate(self._round_specs)]
      for r, out in enumerate(self._permute(*inputs)):
        arrived.update({("round", r, s.device): s.data for s in out.addressable_shards})
    made: dict[tuple[Path, Any], jax.Array] = {}
    for device, program, own, received, keys, _ in self._unpacks:
      ins = [arrived[k if k[0] != "round" else (*k, device)] for k in received]
      made.update(zip(keys, program([buffer(k, device) for k in own], ins)))
    for plan in self._plans:
      if plan.kept is not None and _mine(plan.device):
        made[(plan.path, plan.device)] = buffer((plan.kept.source, plan.path), plan.device)
    return [self._assemble(leaves, mesh, made) for leaves, mesh in self.classes]

  @staticmethod
  def _assemble(leaves, mesh, made) -> dict[Path, jax.Array] | None:
    local = [d for d in mesh.devices.flat if _mine(d)]
    if not local:
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
      out[leaf.path] = jax.make_array_from_single_device_arrays(
          shape, NamedSharding(mesh, spec), [made[(leaf.path, d)] for d in local])
    return out


def _near(a, b) -> bool:
  """Two devices of one process (a buffer between them is a ``jax.device_put``)."""
  return getattr(a, "process_index", 0) == getattr(b, "process_index", 0)


class ClassMove:
  """One new class's part of a ``PeerMove`` (a ``placement.DirectMove``).

  Args:
    move: the move. index: the class. lowers: its ``lower`` lowers the move (False where
      the move is lowered once for every class, across processes).
  """

  def __init__(self, move: PeerMove, index: int, lowers: bool = True):
    self.move, self.index, self.lowers = move, index, lowers

  @property
  def copied_bytes(self) -> int:
    return self.move.copied_bytes

  def __call__(self) -> dict[Path, jax.Array]:
    return self.move.run()[self.index]

  def lower(self) -> list[jax.stages.Lowered] | None:
    if not self.lowers:
      return [] if self.move.missing is None else None
    return self.move.lower()
