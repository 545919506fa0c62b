"""How one parameter's gradient goes to its sync positions and back (see ``sync``).

Each parameter is described once per (parameter structure, TP degree,
``t_min``, regroups) by a frozen descriptor: ``SplitSync`` for a
``TPParam`` (its flat layout and its ``regroup.Regroup``), ``ReplicatedSync``
for a variable every slot holds whole (norm scales). Both give the length of
the parameter's sync block and move a local gradient to it and back inside
a class ``shard_map`` body, so the walkers in ``sync`` only loop over the
descriptors.

``sync_leaves`` builds them from a class's local parameter state (shapes
suffice) and keeps them for the next step maker or traffic count that asks
with the same structure.

A stacked parameter (``layers.stack``: ``layers`` metadata ``n``) is laid out
layer by layer: its sync block is ``[n, block]``, each layer flattened and
regrouped alone, and it joins a buffer of its own (``SyncLeaf.buffer``,
``[n, L]``). So no index, in the packing or in the sharded optimizer, runs
past one layer's elements at any depth: flattened whole, Llama-3-70B's
``mlp/down/kernel`` would be indexed to 4.7e9 per device at TP degree 7;
one layer's run is 5.9e7.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ntp_jax.layers.params import TPParam
from ntp_jax.parallel.regroup import Regroup, equal_regroup
from ntp_jax.sharding.collectives import (
  copy_shared_from_last,
  reshard_uneven,
  slot_position,
  tp_sum,
)
from ntp_jax.sharding.layout import Layout, apportion, owner_layout


def sync_layout(layout: Layout, t_min: int) -> Layout:
  """The sync layout of a flattened parameter split by ``layout``, over the same positions.

  The sync only adds gradients, so it ignores shard units: positions
  ``0 .. t_min-1`` hold near-equal contiguous runs of single elements
  (largest remainder, so peer-group buffers carry at most one padded
  element); positions ``t_min ..`` hold nothing.
  """
  units = apportion(layout.size, [1.0] * t_min) + (0,) * (layout.degree - t_min)
  return Layout(tp=layout.tp, live_slots=layout.live_slots, units=units, unit_size=1)


def flat_layout(layout: Layout, other: int) -> Layout:
  """``layout`` of a parameter flattened with its split axis first (``other`` = the rest).

  Shared units (last in logical order) are counted once, on the last live
  slot, right after its own run; the other slots' copies are treated as
  padding (``SplitSync.to_block`` zeroes them).
  """
  return owner_layout(layout).with_unit_size(layout.unit_size * other)


def replicated_layout(numel: int, degree: int, t_min: int) -> Layout:
  """Sync layout of a replicated variable, flattened to ``numel`` elements."""
  return sync_layout(Layout(tp=degree, live_slots=tuple(range(degree)),
                            units=(numel,) + (0,) * (degree - 1)), t_min)


def path_key(path: tuple) -> str:
  """``('blocks', 'mlp', 'gate', 'kernel')`` -> ``'blocks/mlp/gate/kernel'``."""
  return "/".join(str(p) for p in path)


LOSS_DTYPE = "float32"  # the buffer that also carries the replica's loss (its last element)


def buffer_name(dtype: str, layers: int = 0) -> str:
  """The sync buffer of a parameter of ``dtype`` (name) and ``layers`` stacked layers (0: not
  stacked): ``"bfloat16"`` (``[L]`` per position), ``"bfloat16/80 layers"`` (``[80, L]``)."""
  return f"{dtype}/{layers} layers" if layers else dtype


def buffer_dtype(name: str) -> str:
  """The element dtype (name) of the sync buffer ``name`` (``buffer_name``)."""
  return name.split("/")[0]


def _traced_once(method):
  """``method(self, x)`` of a descriptor as a nested jit with ``self`` static (XLA inlines
  it): traced once per equal descriptor and input type, then reused by the gradient half,
  the packing of the parameters and of each optimizer moment, and the process's next run."""
  return jax.jit(method, static_argnums=0)


def _by_slot(values) -> jax.Array:
  return jnp.asarray(values, jnp.int32)[slot_position()]


def _masked(x: jax.Array, length: jax.Array) -> jax.Array:
  return jnp.where(jnp.arange(x.shape[0]) < length, x, jnp.zeros((), x.dtype))


def _last_slot_keeps_shared(value: jax.Array, layout: Layout, axis: int) -> jax.Array:
  """Zero the shared units' copies on every slot but the last (they are equal)."""
  if not layout.shared_units:
    return value
  shape = [1] * value.ndim
  shape[axis] = layout.block
  own = (jnp.arange(layout.block) < layout.own_size).reshape(shape)
  last = slot_position() == layout.degree - 1
  return jnp.where(own | last, value, jnp.zeros((), value.dtype))


@dataclasses.dataclass(frozen=True)
class SplitSync:
  """A ``TPParam``'s sync: its flat layout cut into core and extra parts by its regroup.

  Attributes:
    key: the parameter's path (``path_key``). dtype: its dtype name.
    shape: one device's block of one layer, without the slot axis (the split axis
      ``block`` long).
    layout, axis: the parameter's TP layout and split axis (one layer's block coordinates).
    degree: the class's TP degree.
    flat: ``flat_layout`` of one layer (elements, shared units on the last slot).
    regroup: its sync positions (the same for every class).
    layers: stacked layers (``layers.stack``), each synced alone; 0: not stacked.
  """

  key: str
  dtype: str
  shape: tuple[int, ...]
  layout: Layout
  axis: int
  degree: int
  flat: Layout
  regroup: Regroup
  layers: int = 0

  @property
  def block(self) -> int:
    """Elements of one layer of this parameter in one position's sync buffer."""
    return self.regroup.block

  @property
  def numel(self) -> int:
    """Logical elements of the parameter (every layer)."""
    return self.flat.size * max(self.layers, 1)

  @property
  def buffer(self) -> str:
    """The sync buffer this parameter joins (``buffer_name``)."""
    return buffer_name(self.dtype, self.layers)

  @property
  def position_size(self) -> int:
    """Elements of this parameter in one position's sync buffer (every layer)."""
    return self.block * max(self.layers, 1)

  def to_block(self, value: jax.Array) -> jax.Array:
    """Inside the body: this device's gradient block ``[1, *shape]`` -> ``[1, block]``
    (stacked: ``[1, layers, *shape]`` -> ``[1, layers, block]``, layer by layer)."""
    if not self.layers:
      return self._layer_to_block(value)
    return jax.vmap(self._layer_to_block, in_axes=1, out_axes=1)(value)

  def from_block(self, block: jax.Array) -> jax.Array:
    """Inside the body: synced ``[1, block]`` -> the gradient block ``[1, *shape]``
    (stacked: ``[1, layers, block]`` -> ``[1, layers, *shape]``)."""
    if not self.layers:
      return self._layer_from_block(block)
    return jax.vmap(self._layer_from_block, in_axes=1, out_axes=1)(block)

  @property
  def pieces(self) -> tuple[Layout, Layout | None]:
    """Each slot's core and extra piece of ``flat`` (``Regroup.pieces``)."""
    return self.regroup.pieces(self.flat)

  @property
  def positions(self) -> tuple[Layout, Layout | None]:
    """Where the core and extra parts are synced (``Regroup.positions``)."""
    return self.regroup.positions(self.flat)

  @_traced_once
  def _layer_to_block(self, value: jax.Array) -> jax.Array:
    """``to_block`` of one layer."""
    value = _last_slot_keeps_shared(value, self.layout, 1 + self.axis)
    # Split axis first, then flatten: the slot's elements are one contiguous run.
    run = jnp.moveaxis(value[0], self.axis, 0).reshape(-1)
    (core_src, extra_src), (core_dst, extra_dst) = self.pieces, self.positions
    core = _masked(run[:core_src.block], _by_slot(core_src.sizes))
    parts = [reshard_uneven(core, core_src, core_dst, 0)]
    if extra_src is not None:  # this slot's extra piece starts right after its core piece
      padded = jnp.pad(run, (0, extra_src.block))
      extra = jax.lax.dynamic_slice_in_dim(padded, _by_slot(core_src.sizes), extra_src.block)
      parts.append(reshard_uneven(_masked(extra, _by_slot(extra_src.sizes)), extra_src,
                                  extra_dst, 0))
    return jnp.concatenate(parts)[None]

  @_traced_once
  def _layer_from_block(self, block: jax.Array) -> jax.Array:
    """``from_block`` of one layer."""
    moved_shape = (self.shape[self.axis],) + tuple(
        n for i, n in enumerate(self.shape) if i != self.axis)
    src, regroup = self.flat, self.regroup
    (core_src, extra_src), (core_dst, extra_dst) = self.pieces, self.positions
    core = reshard_uneven(block[0, :regroup.core_block], core_dst, core_src, 0)
    run = jnp.pad(core, (0, src.block - core_src.block))
    if extra_src is not None:  # put the extra piece back right after the core piece
      extra = reshard_uneven(block[0, regroup.core_block:], extra_dst, extra_src, 0)
      room = jnp.zeros((src.block + extra_src.block,), extra.dtype)
      shifted = jax.lax.dynamic_update_slice_in_dim(room, extra, _by_slot(core_src.sizes), 0)
      run = jnp.where(jnp.arange(src.block) < _by_slot(core_src.sizes), run,
                      shifted[:src.block])
    value = jnp.moveaxis(run.reshape(moved_shape), 0, self.axis)[None]
    return copy_shared_from_last(value, self.layout, 1 + self.axis)

  def intra_domain_bytes(self, replicas: int, itemsize: int) -> int:
    """Bytes phases 1 and 3 send inside the domains of ``replicas`` replicas of the class."""
    moved = 2 * self.regroup.moved(self.flat) * itemsize * replicas  # there and back
    # Shared units come back to every slot by an all-reduce over the domain.
    shared = self.layout.shared_units * self.flat.unit_size
    layer = moved + int(2 * (self.degree - 1) * shared * itemsize) * replicas
    return layer * max(self.layers, 1)


@dataclasses.dataclass(frozen=True)
class ReplicatedSync:
  """A variable every slot holds whole (norm scales): cut into near-equal runs.

  Attributes:
    key: the variable's path (``path_key``). dtype: its dtype name.
    shape: its shape. degree: the class's TP degree.
    flat: ``replicated_layout`` of its elements.
  """

  key: str
  dtype: str
  shape: tuple[int, ...]
  degree: int
  flat: Layout

  @property
  def block(self) -> int:
    return self.flat.block

  @property
  def numel(self) -> int:
    return int(np.prod(self.shape))

  @property
  def buffer(self) -> str:
    return buffer_name(self.dtype, 0)

  @property
  def position_size(self) -> int:
    return self.block

  @_traced_once
  def to_block(self, value: jax.Array) -> jax.Array:
    """Inside the body: the whole gradient -> this position's run ``[1, block]``."""
    flat = self.flat
    padded = jnp.pad(value.reshape(-1), (0, flat.block))
    piece = jax.lax.dynamic_slice_in_dim(padded, _by_slot(flat.offsets), flat.block)
    # A leading slot axis of length 1, as on the blocks of split parameters.
    return jnp.where(jnp.arange(flat.block) < _by_slot(flat.sizes), piece, 0)[None]

  @_traced_once
  def from_block(self, block: jax.Array) -> jax.Array:
    """Inside the body: synced runs -> the whole gradient on every slot (masked all-reduce)."""
    numel = self.numel
    placed = jax.lax.dynamic_update_slice_in_dim(
        jnp.zeros((numel + self.flat.block,), block.dtype), block[0], _by_slot(self.flat.offsets),
        0)
    return tp_sum(placed[:numel]).reshape(self.shape)

  def intra_domain_bytes(self, replicas: int, itemsize: int) -> int:
    """Bytes phase 3 sends re-assembling the variable with an all-reduce over each domain."""
    degree = self.degree
    return int(2 * (degree - 1) / degree * self.numel * itemsize) * degree * replicas


SyncLeaf = SplitSync | ReplicatedSync

# The longest run the sync's packing and the sharded optimizer index with int32 (JAX's
# index type while ``jax_enable_x64`` is off): one layer's, at any depth.
INT32_MAX = 2 ** 31 - 1


def buffer_shapes(leaves: tuple[SyncLeaf, ...], loss: bool = True) -> dict[str, tuple[int, ...]]:
  """``buffer name -> shape`` of one position's sync buffers (``sync.pack_buffers``):
  ``(L,)``, or ``(layers, L)`` for stacked parameters; ``loss``: the float32 buffer ends
  with the replica's loss (one element)."""
  lengths: dict[str, int] = {LOSS_DTYPE: 1} if loss else {}
  rows: dict[str, int] = {}
  for leaf in leaves:
    lengths[leaf.buffer] = lengths.get(leaf.buffer, 0) + leaf.block
    rows[leaf.buffer] = getattr(leaf, "layers", 0)
  return {name: ((rows[name],) if rows.get(name) else ()) + (n,)
          for name, n in lengths.items()}


def int32_overrun(leaves: tuple[SyncLeaf, ...], sharded: bool = True) -> tuple[str, int] | None:
  """``(what, elements)`` of the first run the split step would index past ``INT32_MAX``
  elements on one device: a parameter's packing (one layer's run on its slot plus its extra
  piece; a replicated one's elements plus its run), or, with ``sharded``, a buffer's row
  (``buffer_shapes``), which the sharded optimizer cuts into pieces at dynamic offsets (the
  sync alone slices rows at static ones); None when every one fits. The one place the
  bound is known: the split step's index arithmetic is int32."""
  for leaf in leaves:
    indexed = (leaf.flat.block if isinstance(leaf, SplitSync) else leaf.numel) + leaf.block
    if indexed > INT32_MAX:
      return leaf.key, indexed
  for name, shape in buffer_shapes(leaves).items() if sharded else ():
    if shape[-1] > INT32_MAX:
      return f"the {name} sync buffer", shape[-1]
  return None


def sync_leaves(params: nnx.State, degree: int, t_min: int,
                regroups: dict[str, Regroup] | None = None) -> tuple[SyncLeaf, ...]:
  """The sync descriptor of every parameter, in ``nnx.to_flat_state`` order.

  Args:
    params: a class's local (unstacked) parameter state, concrete or
      abstract: ``TPParam`` values ``[slots, *block]`` (any slot count),
      other variables whole.
    degree: the class's TP degree. t_min: the job's smallest TP degree.
    regroups: ``path_key -> Regroup`` of split parameters (``sync.regroup_plan``);
      a parameter missing there gets near-equal runs (``regroup.equal_regroup``).

  Returns:
    One ``SplitSync`` or ``ReplicatedSync`` per parameter; equal arguments
    give the same (cached) tuple. ``Layout`` equality ignores live slots, so
    a cached descriptor may carry another class's live slots: nothing here
    reads them (the same reason ``ProgramCache`` shares steps across them).
  """
  signature = tuple(
      (path_key(path), isinstance(v, TPParam), tuple(v.get_value().shape),
       jnp.dtype(v.get_value().dtype).name,
       (v.tp_layout, v.tp_axis, getattr(v, "layers", 0)) if isinstance(v, TPParam) else None)
      for path, v in nnx.to_flat_state(params))
  return _sync_leaves(signature, degree, t_min, tuple(sorted((regroups or {}).items())))


# Descriptors only (layouts, regroups, shapes: a schedule worked out from the plan), no
# jitted or compiled program: programs live in the run's ``ProgramCache``.
@functools.lru_cache(maxsize=64)
def _sync_leaves(signature: tuple, degree: int, t_min: int,
                 regroups: tuple[tuple[str, Regroup], ...]) -> tuple[SyncLeaf, ...]:
  chosen = dict(regroups)
  out: list[SyncLeaf] = []
  for key, split, shape, dtype, tp in signature:
    if split:
      layout, axis, layers = tp
      block_shape = shape[1:]  # drop the slot axis
      if layers:  # one layer's block: the layer axis leads
        block_shape, axis = block_shape[1:], axis - 1
      flat = flat_layout(layout, int(np.prod(block_shape)) // layout.block)
      regroup = chosen.get(key) or equal_regroup(flat.size, t_min)
      out.append(SplitSync(key, dtype, block_shape, layout, axis, degree, flat, regroup,
                           layers))
    else:
      out.append(ReplicatedSync(key, dtype, shape, degree,
                                replicated_layout(int(np.prod(shape)), degree, t_min)))
  return tuple(out)
