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
                leaves: Sequence[Leaf], devices: np.ndarray) -> list[BlockPlan]:
  """Where every element of a new class's buffers comes from (metadata only; nothing read).

  Args:
    old: per old class, its ``[replicas, degree]`` device grid (or mesh) and ``path -> Leaf``.
    dead: failed devices (never a source).
    leaves: the new class's leaves (``placement.leaves_of`` of its abstract state).
    devices: the new class's ``[replicas, degree]`` device grid.

  Returns:
    One ``BlockPlan`` per new device and leaf, devices in grid order. An element the device
    held on the old plan stays (a ``LOCAL`` part); the others come from the live holder with
    the fewest bytes to send so far, ties to the lowest ``Holding.order``.

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
  for row in np.asarray(devices):
    for position, device in enumerate(row):
      for leaf in leaves:
        candidates = [h for h in holdings.get(leaf.path, {}).values() if _same_leaf(h.leaf, leaf)]
        plans.append(_plan_block(leaf, position, device, candidates, load))
  return plans


def _plan_block(leaf: Leaf, position: int, device: Any, candidates: list[Holding],
                load: dict[Any, int]) -> BlockPlan:
  own = next((h for h in candidates if h.device == device), None)
  others = sorted((h for h in candidates if h.device != device), key=lambda h: h.order)
  if leaf.layout is None:
    if own is not None and own.leaf.dtype == leaf.dtype:
      return BlockPlan(leaf.path, device, leaf, own, (), ())
    source = own or _least_loaded(others, load)
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
      holder, (start, stop_run, pos) = min(
          holders, key=lambda hr: (load.get(hr[0].device, 0), hr[0].order))
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


def _least_loaded(holders: list[Holding], load: dict[Any, int]) -> Holding | None:
  return min(holders, key=lambda h: (load.get(h.device, 0), h.order), default=None)


# -- the programs (module level: a recipe is all they depend on, and it keys the cache) ------

def _pack(recipe, buffers):
  """One sending device: per flat output, its items (input, axis, start, length) cut from the
  buffers and laid end to end (``axis`` -1: the whole buffer)."""
  _, flats = recipe
  out = []
  for items in flats:
    parts = []
    for index, axis, start, length in items:
      x = buffers[index]
      if axis >= 0:
        x = jax.lax.slice_in_dim(x[0, 0], start, start + length, axis=axis)
      parts.append(x.reshape(-1))
    out.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])
  return out


def _unpack(recipe, own, received):
  """One receiving device: every new buffer from its parts (zeros, its own old blocks, the
  received flat buffers)."""
  _, _, outputs = recipe
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


def _program(cache: ProgramCache, kind: str, fn: Callable, recipe: Any) -> Any:
  return cache.program(("peer move", kind, recipe),
                       lambda: jax.jit(functools.partial(fn, recipe)))


def _spec(shape, dtype, device) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype), sharding=SingleDeviceSharding(device))


class PeerMove:
  """A new class's state from the old plan's live devices: the plan (``plan_blocks``) and its
  programs, made from metadata at construction.

  Args:
    old: per old class, its mesh (or device grid) and ``path -> Leaf``.
    dead: failed devices. leaves: the new class's leaves. mesh: its ``('dp', 'tp')`` mesh.
    read: ``(old class, path) -> {device: buffer}``, the old state's per-device buffers
      (asked only when the move runs).
    cache: where the programs are kept (default: a fresh ``ProgramCache``).

  Attributes:
    missing: why some element has no live holder (then ``lower`` gives None and the call
      raises), else None.
    copied_bytes: bytes carried between devices (each ``jax.device_put`` buffer).
    ran: the move has run.

  Calling it runs the move and returns ``path -> jax.Array`` in the class sharding (blocks
  ``P('dp', 'tp')``, replica-stacked ``P('dp')``, bare ``P()``); ``lower`` lowers the same
  programs for the buffers it will meet.
  """

  def __init__(self, old: Sequence[tuple[Any, dict[Path, Leaf]]], dead: Collection[Any],
               leaves: Sequence[Leaf], mesh: Mesh,
               read: Callable[[int, Path], dict[Any, jax.Array]],
               cache: ProgramCache | None = None):
    self.leaves, self.mesh, self._read = list(leaves), mesh, read
    self.missing: str | None = None
    self.copied_bytes = 0
    self.ran = False
    try:
      self._plans = plan_blocks(old, dead, self.leaves, mesh.devices)
    except LookupError as error:
      self.missing, self._plans = str(error), []
      return
    old_leaves = {(source, path): leaf for source, (_, by_path) in enumerate(old)
                  for path, leaf in by_path.items()}
    self._make(old_leaves, cache or ProgramCache())

  def _make(self, old_leaves: dict[tuple[int, Path], Leaf], cache: ProgramCache) -> None:
    # Per sending device: its input buffers and, per (receiver, dtype), the items of one flat.
    sends: dict[Any, dict[tuple[Any, str], list]] = {}
    inputs: dict[Any, dict[tuple[int, Path], int]] = {}
    where: dict[tuple[Path, Any, int], tuple[Any, str, int]] = {}  # part -> flat, offset
    sizes: dict[tuple[Any, Any, str], int] = {}

    def add_input(device, key):
      return inputs.setdefault(device, {}).setdefault(key, len(inputs.get(device, {})))

    for plan in self._plans:
      sources = dict(plan.sources)
      for n, part in enumerate(plan.parts):
        if part.device is None or part.device == plan.device:
          continue
        key = (sources[part.device], plan.path)
        old = old_leaves[key]
        dtype = str(old.dtype)
        index = add_input(part.device, key)
        flat = sends.setdefault(part.device, {}).setdefault((plan.device, dtype), [])
        if old.layout is None:
          item, count = (index, -1, 0, 0), int(np.prod(buffer_shape(old)))
        else:
          row = int(np.prod(old.shape)) // old.shape[old.axis]
          item, count = (index, old.axis, part.start, part.length), part.length * row
        offset = sizes.get((part.device, plan.device, dtype), 0)
        where[(plan.path, plan.device, n)] = (part.device, dtype, offset)
        sizes[(part.device, plan.device, dtype)] = offset + count
        flat.append(item)
        self.copied_bytes += count * old.dtype.itemsize
    self._packs = []  # (device, program, input keys, flat keys, specs)
    for device, flats in sends.items():
      keys = list(inputs[device])
      specs = [_spec(buffer_shape(old_leaves[k]), old_leaves[k].dtype, device) for k in keys]
      recipe = (tuple((s.shape, str(s.dtype)) for s in specs),
                tuple(tuple(items) for items in flats.values()))
      self._packs.append((device, _program(cache, "pack", _pack, recipe), keys,
                          [(device,) + k for k in flats], specs))
    self._unpacks = []  # (device, program, own keys, received keys, output paths, specs)
    by_device: dict[Any, list[BlockPlan]] = {}
    for plan in self._plans:
      by_device.setdefault(plan.device, []).append(plan)
    for device, plans in by_device.items():
      built = [p for p in plans if p.kept is None]
      if not built:
        continue
      own: dict[tuple[int, Path], int] = {}
      received = [(sender, receiver, dtype) for sender, flats in sends.items()
                  for receiver, dtype in flats if receiver == device]
      outputs = []
      for plan in built:
        sources = dict(plan.sources)
        parts = []
        for n, part in enumerate(plan.parts):
          if part.device is None:
            parts.append((ZERO, 0, 0, part.length))
          elif part.device == device:
            index = own.setdefault((sources[device], plan.path), len(own))
            parts.append((LOCAL, index, part.start, part.length))
          else:
            sender, dtype, offset = where[(plan.path, device, n)]
            parts.append((RECEIVED, received.index((sender, device, dtype)), offset, part.length))
        leaf = plan.leaf
        axis = leaf.axis if leaf.layout is not None else -1
        outputs.append((buffer_shape(leaf), str(leaf.dtype), axis, tuple(parts)))
      own_specs = [_spec(buffer_shape(old_leaves[k]), old_leaves[k].dtype, device) for k in own]
      received_specs = [_spec((sizes[k],), k[2], device) for k in received]
      recipe = (tuple((s.shape, str(s.dtype)) for s in own_specs),
                tuple((s.shape, str(s.dtype)) for s in received_specs), tuple(outputs))
      self._unpacks.append((device, _program(cache, "unpack", _unpack, recipe), list(own),
                            received, [p.path for p in built], own_specs + received_specs))

  def lower(self) -> list[jax.stages.Lowered] | None:
    """The move's programs lowered for the buffers they will meet (nothing read); None when
    some element has no live holder (that recovery restores a checkpoint)."""
    if self.missing is not None:
      return None
    lowered = [program.lower(specs) for _, program, _, _, specs in self._packs]
    for _, program, own, _, _, specs in self._unpacks:
      lowered.append(program.lower(specs[:len(own)], specs[len(own):]))
    return lowered

  def __call__(self) -> dict[Path, jax.Array]:
    """Run the move: ``path -> jax.Array`` of the new class.

    Raises:
      LookupError: some element has no live holder (``missing``).
    """
    if self.missing is not None:
      raise LookupError(self.missing)
    self.ran = True
    buffers: dict[tuple[int, Path], dict[Any, jax.Array]] = {}

    def buffer(key, device):
      if key not in buffers:
        buffers[key] = self._read(*key)
      x = buffers[key][device]
      # A one-device class's buffer may carry its class sharding: the programs were lowered
      # for a single-device one (the same buffer, relabelled; nothing is copied).
      return (x if isinstance(x.sharding, SingleDeviceSharding)
              else jax.device_put(x, SingleDeviceSharding(device)))

    flats, targets = [], []
    for device, program, keys, flat_keys, _ in self._packs:
      flats += program([buffer(k, device) for k in keys])
      targets += [k[1] for k in flat_keys]
    flat_keys = [k for _, _, _, keys, _ in self._packs for k in keys]
    arrived = dict(zip(flat_keys, jax.device_put(flats, targets)))
    made: dict[tuple[Path, Any], jax.Array] = {}
    for device, program, own, received, paths, _ in self._unpacks:
      made.update(zip(((p, device) for p in paths),
                      program([buffer(k, device) for k in own],
                              [arrived[k] for k in received])))
    for plan in self._plans:
      if plan.kept is not None:
        made[(plan.path, plan.device)] = buffer((plan.kept.source, plan.path), plan.device)
    replicas, degree = self.mesh.devices.shape
    out = {}
    for leaf in self.leaves:
      if leaf.layout is not None:
        shape, spec = (replicas, degree) + block_shape(leaf), P(DP, TP)
      elif leaf.stacked:
        shape, spec = (replicas,) + leaf.shape, P(DP)
      else:
        shape, spec = leaf.shape, P()
      out[leaf.path] = jax.make_array_from_single_device_arrays(
          shape, NamedSharding(self.mesh, spec),
          [made[(leaf.path, d)] for d in self.mesh.devices.flat])
    return out
