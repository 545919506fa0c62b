"""DP gradient sync across replica classes of different TP degree.

Replicas of one class share a layout, replicas of different classes do not,
so their gradient blocks cannot be all-reduced slot by slot. The sync goes
through sync positions shared by every replica: each parameter, flattened
with its split axis first, is laid out over ``t_min`` near-equal runs held
by the first ``t_min`` live slots of every replica (the *core* slots;
``t_min`` = the smallest TP degree in the job); which elements sit where is
the parameter's ``regroup.Regroup`` (near-equal contiguous runs, or nested
on a wider replica's layout), chosen once for the plan (``regroup_plan``).
Three phases per step:

1. inside each scale-up domain, every replica moves its gradient blocks from
   its own layout to the sync positions (``collectives.reshard_uneven``:
   only the elements that change device move; replicated parameters are
   cut locally) and packs them into one flat buffer per dtype and device,
   its loss share last (``pack_buffers``);
2. across domains, each *peer group* (core slot ``j`` of every live replica)
   all-reduces its buffers: one program over a ``('replica', 'peer')`` mesh
   of the core devices, assembled from the class programs' per-device
   buffers without copies, each process handing over its own devices';
3. inside each domain, the synced buffers are unpacked and moved back to
   the replica's layout (replicated parameters and shared units are
   re-assembled by a masked all-reduce).

Bytes per step (``G`` = logical gradient bytes, ``R`` live replicas): across
domains, each peer group all-reduces ``G / t_min`` (a ring sends
``2 (R-1)/R * G / t_min`` per core device), the same total per replica as a
uniform DP all-reduce of ``G``; inside domains, ``sync_traffic`` counts what
the regroups move (figures and the comparison with a nested regroup in
``docs/sync.md``).
Source: Arfeen et al., arXiv:2504.06095, Sec. 4.2 (gradient sync between
replicas of different TP degree), in our own formulation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.layers.params import TPParam
from ntp_jax.parallel.regroup import Regroup, choose_regroup, equal_regroup
from ntp_jax.sharding.collectives import (
  copy_shared_from_last,
  reshard_uneven,
  slot_position,
  tp_sum,
)
from ntp_jax.sharding.layout import Layout, apportion, owner_layout

REPLICA = "replica"  # axis of the sync mesh: every live replica
PEER = "peer"  # axis of the sync mesh: core slot position (peer group)


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
  padding (``to_sync_blocks`` zeroes them).
  """
  return owner_layout(layout).with_unit_size(layout.unit_size * other)


def _last_slot_keeps_shared(value: jax.Array, layout: Layout, axis: int) -> jax.Array:
  """Zero the shared units' copies on every slot but the last (they are equal)."""
  if not layout.shared_units:
    return value
  shape = [1] * value.ndim
  shape[axis] = layout.block
  own = (jnp.arange(layout.block) < layout.own_size).reshape(shape)
  last = slot_position() == layout.degree - 1
  return jnp.where(own | last, value, jnp.zeros((), value.dtype))


def _flat_layout(numel: int, degree: int, t_min: int) -> Layout:
  """Sync layout of a replicated variable, flattened to ``numel`` elements."""
  return sync_layout(Layout(tp=degree, live_slots=tuple(range(degree)),
                            units=(numel,) + (0,) * (degree - 1)), t_min)


def regroup_of(regroups: dict | None, key: str, src: Layout, t_min: int) -> Regroup:
  """The parameter's ``Regroup`` (``regroups[key]``), or near-equal runs when not given."""
  if regroups is not None and key in regroups:
    return regroups[key]
  return equal_regroup(src.size, t_min)


def _by_slot(values) -> jax.Array:
  return jnp.asarray(values, jnp.int32)[slot_position()]


def _masked(x: jax.Array, length: jax.Array) -> jax.Array:
  return jnp.where(jnp.arange(x.shape[0]) < length, x, jnp.zeros((), x.dtype))


def to_sync_blocks(grads: nnx.State, degree: int, t_min: int,
                   regroups: dict[str, Regroup] | None = None) -> dict:
  """Inside a class ``shard_map`` body: local gradients -> local sync blocks.

  Args:
    grads: this device's gradients (``TPParam`` blocks ``[1, ...]``, replicated
      variables whole).
    degree: the class's TP degree. t_min: the job's smallest TP degree.
    regroups: ``path -> regroup.Regroup`` of each split parameter, the same
      for every class (``regroup_plan``); default near-equal runs.

  Returns:
    Flat dict ``path -> [1, sync block]`` (a leading slot axis of length 1):
    each parameter's core run then extra run at this position.
  """
  out = {}
  for path, v in nnx.to_flat_state(grads):
    key = path_key(path)
    value = v.get_value()
    if isinstance(v, TPParam):
      value = _last_slot_keeps_shared(value, v.tp_layout, 1 + v.tp_axis)
      # Split axis first, then flatten: the slot's elements are one contiguous run.
      run = jnp.moveaxis(value[0], v.tp_axis, 0).reshape(-1)
      src = flat_layout(v.tp_layout, run.size // v.tp_layout.block)
      regroup = regroup_of(regroups, key, src, t_min)
      (core_src, extra_src), (core_dst, extra_dst) = regroup.pieces(src), regroup.positions(src)
      core = _masked(run[:core_src.block], _by_slot(core_src.sizes))
      parts = [reshard_uneven(core, core_src, core_dst, 0)]
      if extra_src is not None:  # this slot's extra piece starts right after its core piece
        padded = jnp.pad(run, (0, extra_src.block))
        extra = jax.lax.dynamic_slice_in_dim(padded, _by_slot(core_src.sizes), extra_src.block)
        parts.append(reshard_uneven(_masked(extra, _by_slot(extra_src.sizes)), extra_src,
                                    extra_dst, 0))
      out[key] = jnp.concatenate(parts)[None]
    else:
      flat = _flat_layout(value.size, degree, t_min)
      padded = jnp.pad(value.reshape(-1), (0, flat.block))
      start = jnp.asarray(flat.offsets, jnp.int32)[slot_position()]
      piece = jax.lax.dynamic_slice_in_dim(padded, start, flat.block)
      size = jnp.asarray(flat.sizes, jnp.int32)[slot_position()]
      # A leading slot axis of length 1, as on the blocks of split parameters.
      out[key] = jnp.where(jnp.arange(flat.block) < size, piece, 0)[None]
  return out


def from_sync_blocks(blocks: dict, template: nnx.State, degree: int, t_min: int,
                     regroups: dict[str, Regroup] | None = None) -> nnx.State:
  """Inside a class ``shard_map`` body: synced local blocks -> gradients in the class layout.

  ``template`` is the local (unstacked) parameter state; ``regroups`` as for
  ``to_sync_blocks``. Replicated variables come back identical on every slot
  (a masked all-reduce).
  """
  restored = []
  for path, v in nnx.to_flat_state(template):
    key = path_key(path)
    block = blocks[key]
    if isinstance(v, TPParam):
      local_shape = v.get_value().shape[1:]
      moved_shape = (local_shape[v.tp_axis],) + tuple(
          n for i, n in enumerate(local_shape) if i != v.tp_axis)
      src = flat_layout(v.tp_layout, int(np.prod(moved_shape[1:])))
      regroup = regroup_of(regroups, key, src, t_min)
      (core_src, extra_src), (core_dst, extra_dst) = regroup.pieces(src), regroup.positions(src)
      core = reshard_uneven(block[0, :regroup.core_block], core_dst, core_src, 0)
      run = jnp.pad(core, (0, src.block - core_src.block))
      if extra_src is not None:  # put the extra piece back right after the core piece
        extra = reshard_uneven(block[0, regroup.core_block:], extra_dst, extra_src, 0)
        room = jnp.zeros((src.block + extra_src.block,), extra.dtype)
        shifted = jax.lax.dynamic_update_slice_in_dim(room, extra, _by_slot(core_src.sizes), 0)
        run = jnp.where(jnp.arange(src.block) < _by_slot(core_src.sizes), run,
                        shifted[:src.block])
      value = jnp.moveaxis(run.reshape(moved_shape), 0, v.tp_axis)[None]
      value = copy_shared_from_last(value, v.tp_layout, 1 + v.tp_axis)
    else:
      shape = v.get_value().shape
      numel = int(np.prod(shape))
      flat = _flat_layout(numel, degree, t_min)
      start = jnp.asarray(flat.offsets, jnp.int32)[slot_position()]
      placed = jax.lax.dynamic_update_slice_in_dim(
          jnp.zeros((numel + flat.block,), block.dtype), block[0], start, 0)
      value = tp_sum(placed[:numel]).reshape(shape)
    restored.append((path, v.replace(value)))
  return nnx.from_flat_state(restored)


def path_key(path: tuple) -> str:
  """``('blocks', 'mlp', 'gate', 'kernel')`` -> ``'blocks/mlp/gate/kernel'``."""
  return "/".join(str(p) for p in path)


LOSS_DTYPE = "float32"  # the buffer that also carries the replica's loss (its last element)


def sync_block_sizes(template: nnx.State, degree: int, t_min: int,
                     regroups: dict[str, Regroup] | None = None) -> list[tuple[str, str, int]]:
  """``(path, dtype, length)`` of every parameter's sync block, in ``to_sync_blocks`` order.

  ``template`` is the local (unstacked) parameter state of a class.
  """
  sizes = []
  for path, v in nnx.to_flat_state(template):
    value = v.get_value()
    if isinstance(v, TPParam):
      other = int(np.prod(value.shape[1:])) // v.tp_layout.block
      src = flat_layout(v.tp_layout, other)
      length = regroup_of(regroups, path_key(path), src, t_min).block
    else:
      length = _flat_layout(int(np.prod(value.shape)), degree, t_min).block
    sizes.append((path_key(path), jnp.dtype(value.dtype).name, length))
  return sizes


def regroup_plan(class_params: list[tuple[nnx.State, int]], t_min: int) -> dict[str, Regroup]:
  """``path -> Regroup`` of every split parameter, chosen over all classes (``choose_regroup``).

  Args:
    class_params: each class's local (unstacked) parameter state (shapes
      suffice) and its number of replicas.
  """
  sources: dict[str, list[tuple[Layout, int]]] = {}
  for state, replicas in class_params:
    for path, v in nnx.to_flat_state(state):
      if isinstance(v, TPParam):
        other = int(np.prod(v.get_value().shape[1:])) // v.tp_layout.block
        sources.setdefault(path_key(path), []).append(
            (flat_layout(v.tp_layout, other), replicas))
  return {key: choose_regroup(layouts, t_min) for key, layouts in sources.items()}


def pack_buffers(blocks: dict, loss: jax.Array) -> dict[str, jax.Array]:
  """Sync blocks (``path -> [1, n]``) -> one flat buffer per dtype (``dtype -> [1, L]``).

  The ``float32`` buffer ends with ``loss`` (this replica's loss share), so
  the peer-group all-reduce also sums the job's loss.
  """
  groups: dict[str, list[jax.Array]] = {}
  for block in blocks.values():
    groups.setdefault(jnp.dtype(block.dtype).name, []).append(block)
  groups.setdefault(LOSS_DTYPE, []).append(loss.astype(LOSS_DTYPE).reshape(1, 1))
  return {name: jnp.concatenate(parts, axis=1) for name, parts in groups.items()}


def unpack_buffers(buffers: dict[str, jax.Array], sizes: list[tuple[str, str, int]]) -> dict:
  """Inverse of ``pack_buffers``: ``dtype -> [1, L]`` -> ``path -> [1, n]`` (the loss dropped)."""
  offsets = dict.fromkeys(buffers, 0)
  out = {}
  for key, dtype, length in sizes:
    out[key] = jax.lax.slice_in_dim(buffers[dtype], offsets[dtype], offsets[dtype] + length,
                                    axis=1)
    offsets[dtype] += length
  return out


def synced_loss(buffers: dict[str, jax.Array]) -> jax.Array:
  """The job's loss from a class's synced buffers (``[replicas, degree, L]``): any core
  position holds the sum over every live replica."""
  return buffers[LOSS_DTYPE][0, 0, -1]


class CrossClassSync:
  """Phase 2: all-reduce of the core slots' flat buffers over every live replica.

  One buffer per dtype and device: the host-side work per step is a few
  calls per local device, whatever the parameter count. In a multi-process
  job each process hands over the buffers of its own devices and every
  process holding a core slot runs the one all-reduce program.

  Args:
    meshes: each class's ``('dp', 'tp')`` mesh, in class order.
    t_min: the smallest TP degree (core slots per replica).
  """

  def __init__(self, meshes: list[Mesh], t_min: int):
    self.meshes = meshes
    self.t_min = t_min
    grid = [row[:t_min] for mesh in meshes for row in mesh.devices]
    self.mesh = Mesh(np.array(grid, dtype=object), (REPLICA, PEER))
    self.sharding = NamedSharding(self.mesh, P(REPLICA, PEER))
    self.local = any(d.process_index == jax.process_index() for d in self.mesh.devices.flat)
    self._all_reduce = jax.jit(jax.shard_map(
        lambda x: jax.lax.psum(x, REPLICA), mesh=self.mesh,
        in_specs=P(REPLICA, PEER), out_specs=P(REPLICA, PEER)))

  def __call__(self, class_buffers: list[dict | None]) -> list[dict | None]:
    """Sum each buffer over all live replicas.

    Args:
      class_buffers: per class, ``dtype -> [replicas, degree, L]`` arrays
        (``P('dp', 'tp')`` on the class mesh), or None for a class with no
        device in this process.

    Returns:
      The same structure with core positions replaced by the all-reduced
      buffers (positions beyond ``t_min`` keep theirs: they hold no data).
    """
    first = next(b for b in class_buffers if b is not None)
    by_device: dict[str, dict[jax.Device, jax.Array]] = {name: {} for name in first}
    for buffers in class_buffers:
      for name, array in (buffers or {}).items():
        by_device[name].update((s.device, s.data) for s in array.addressable_shards)
    reduced_by_device: dict[str, dict[jax.Device, jax.Array]] = {name: {} for name in first}
    if self.local:
      stacked = {}
      mine = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
      for name, array in first.items():
        shape = (self.mesh.devices.shape[0], self.t_min, array.shape[2])
        stacked[name] = jax.make_array_from_single_device_arrays(
            shape, self.sharding, [by_device[name][d] for d in mine])
      for name, array in self._all_reduce(stacked).items():  # one program for every dtype
        reduced_by_device[name] = {s.device: s.data for s in array.addressable_shards}
    out: list[dict | None] = []
    for c, buffers in enumerate(class_buffers):
      if buffers is None:
        out.append(None)
        continue
      synced = {}
      for name, array in buffers.items():
        pieces = []
        for row in self.meshes[c].devices:
          for j, device in enumerate(row):
            if device.process_index == jax.process_index():
              # Positions beyond t_min hold no data: keep their (empty) buffers.
              pieces.append(reduced_by_device[name][device] if j < self.t_min
                            else by_device[name][device])
        synced[name] = jax.make_array_from_single_device_arrays(array.shape, array.sharding,
                                                                pieces)
      out.append(synced)
    return out


def sync_traffic(plan, abstract_params_by_class: list[nnx.State], itemsize: int = 4,
                 regroups: dict[str, Regroup] | None = None) -> dict:
  """Bytes one gradient sync moves, per step, by phase (see the module docstring).

  Args:
    plan: the job's ``Plan`` (several classes).
    abstract_params_by_class: each class's unstacked parameter state (shapes only).
    itemsize: bytes per gradient element.
    regroups: the sync positions (default: ``regroup_plan`` of the plan, as the job uses;
      ``{}`` for near-equal runs everywhere).

  Returns:
    ``intra_domain``: bytes sent between devices of one scale-up domain,
    summed over all replicas (phases 1 and 3); ``cross_replica``: bytes each
    core device sends in the ring all-reduce of its peer group, summed over
    all core devices (phase 2); ``logical``: the logical gradient bytes ``G``.
  """
  t_min = min(c.degree for c in plan.classes)
  live = len(plan.replicas)
  if regroups is None:
    regroups = regroup_plan([(state, len(c.replicas)) for c, state in
                             zip(plan.classes, abstract_params_by_class)], t_min)
  intra = cross = logical = 0
  for c, state in zip(plan.classes, abstract_params_by_class):
    for path, v in nnx.to_flat_state(state):
      shape = v.get_value().shape
      if isinstance(v, TPParam):
        src = flat_layout(v.tp_layout, int(np.prod(shape[1:])) // v.tp_layout.block)
        dst = regroup_of(regroups, path_key(path), src, t_min)
        intra += 2 * dst.moved(src) * itemsize * len(c.replicas)  # there and back
        # Shared units come back to every slot by an all-reduce over the domain.
        shared = v.tp_layout.shared_units * src.unit_size
        intra += int(2 * (c.degree - 1) * shared * itemsize) * len(c.replicas)
        numel, block = src.size, dst.block
      else:
        numel = int(np.prod(shape))
        block = _flat_layout(numel, c.degree, t_min).block
        # Phase 3 re-assembles the vector with an all-reduce over the domain.
        intra += int(2 * (c.degree - 1) / c.degree * numel * itemsize) * c.degree * len(c.replicas)
      if c.index == 0:
        logical += numel * itemsize
        cross += int(2 * (live - 1) / live * block * itemsize) * t_min * live
  return {"intra_domain": intra, "cross_replica": cross, "logical": logical}

