"""DP gradient sync across replica classes of different TP degree.

Replicas of one class share a layout; replicas of different classes in general
do not (classes of one layout differ only in batch share, under
``ntp.rebalance=constant``), so their gradient blocks cannot be all-reduced
slot by slot. The sync goes
through sync positions shared by every replica: each parameter, flattened
with its split axis first, is laid out over ``t_min`` near-equal runs held
by the first ``t_min`` live slots of every replica (the *core* slots;
``t_min`` = the smallest TP degree in the job); which elements sit where is
the parameter's ``regroup.Regroup`` (near-equal contiguous runs, or nested
on a wider replica's layout), chosen once for the plan (``regroup_plan``).
Each parameter's way there and back is described once, by a
``sync_leaf.SplitSync`` or ``ReplicatedSync`` (``sync_leaf.sync_leaves``);
the walkers here loop over those descriptors. Three phases per step:

1. inside each scale-up domain, every replica moves its gradient blocks from
   its own layout to the sync positions (``collectives.reshard_uneven``:
   only the elements that change device move; replicated parameters are
   cut locally) and packs them into one buffer per dtype and device, its
   loss share last (``pack_buffers``); stacked layers' parameters go layer
   by layer into a ``[layers, L]`` buffer of their own, so every index
   stays within one layer's elements at any depth (``sync_leaf``);
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

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.parallel.regroup import Regroup, choose_regroup
from ntp_jax.parallel.sync_leaf import LOSS_DTYPE, SplitSync, SyncLeaf, sync_leaves
from ntp_jax.sharding.layout import Layout
from ntp_jax.sharding.topology import holds_mine, is_mine, mine

REPLICA = "replica"  # axis of the sync mesh: every live replica
PEER = "peer"  # axis of the sync mesh: core slot position (peer group)


def to_sync_blocks(grads: nnx.State, leaves: Sequence[SyncLeaf]) -> dict:
  """Inside a class ``shard_map`` body: local gradients -> local sync blocks.

  Args:
    grads: this device's gradients (``TPParam`` blocks ``[1, ...]``, replicated
      variables whole).
    leaves: the class's ``sync_leaf.sync_leaves`` (same structure as ``grads``).

  Returns:
    Flat dict ``path -> [1, sync block]`` (a leading slot axis of length 1):
    each parameter's core run then extra run at this position.
  """
  return {leaf.key: leaf.to_block(v.get_value())
          for (_, v), leaf in zip(nnx.to_flat_state(grads), leaves, strict=True)}


def from_sync_blocks(blocks: dict, template: nnx.State, leaves: Sequence[SyncLeaf]) -> nnx.State:
  """Inside a class ``shard_map`` body: synced local blocks -> gradients in the class layout.

  ``template`` is the local (unstacked) parameter state; ``leaves`` its
  ``sync_leaves``. Replicated variables come back identical on every slot
  (a masked all-reduce).
  """
  restored = [(path, v.replace(leaf.from_block(blocks[leaf.key])))
              for (path, v), leaf in zip(nnx.to_flat_state(template), leaves, strict=True)]
  return nnx.from_flat_state(restored)


def regroup_plan(class_leaves: Sequence[tuple[Sequence[SyncLeaf], int]],
                 t_min: int) -> dict[str, Regroup]:
  """``path -> Regroup`` of every split parameter, chosen over all classes (``choose_regroup``).

  Args:
    class_leaves: each class's ``sync_leaves`` (any regroups: only their flat
      layouts are read) and its number of replicas.
  """
  sources: dict[str, list[tuple[Layout, int]]] = {}
  for leaves, replicas in class_leaves:
    for leaf in leaves:
      if isinstance(leaf, SplitSync):
        sources.setdefault(leaf.key, []).append((leaf.flat, replicas))
  return {key: choose_regroup(layouts, t_min) for key, layouts in sources.items()}


def plan_regroups(plan, params_by_class: Sequence[nnx.State]) -> dict[str, Regroup]:
  """The sync positions a job of ``plan`` uses (``regroup_plan`` over every class).

  Args:
    plan: the job's ``Plan``.
    params_by_class: each class's local (unstacked) parameter state, shapes suffice.
  """
  t_min = min(c.degree for c in plan.classes)
  return regroup_plan([(sync_leaves(state, c.degree, t_min), len(c.replicas))
                       for c, state in zip(plan.classes, params_by_class, strict=True)], t_min)


def pack_buffers(blocks: dict, loss: jax.Array,
                 leaves: Sequence[SyncLeaf]) -> dict[str, jax.Array]:
  """Sync blocks (``path -> [1, n]``, stacked ``[1, layers, n]``) -> one buffer per
  ``SyncLeaf.buffer`` (``name -> [1, L]`` or ``[1, layers, L]``).

  ``leaves``: the class's ``sync_leaves``: each block joins the buffer of its parameter's
  dtype (and depth), whatever its own (a float32 tree laid out as bfloat16 parameters,
  master weights or moments, keeps its values in buffers of the gradients' layout;
  ``unpack_buffers``). The ``float32`` buffer ends with ``loss`` (this replica's loss
  share), so the peer-group all-reduce also sums the job's loss.
  """
  groups: dict[str, list[jax.Array]] = {}
  for leaf in leaves:
    groups.setdefault(leaf.buffer, []).append(blocks[leaf.key])
  groups.setdefault(LOSS_DTYPE, []).append(loss.astype(LOSS_DTYPE).reshape(1, 1))
  return {name: jnp.concatenate(parts, axis=-1) for name, parts in groups.items()}


def unpack_buffers(buffers: dict[str, jax.Array], leaves: Sequence[SyncLeaf]) -> dict:
  """Inverse of ``pack_buffers`` (the loss dropped).

  ``leaves``: the class's ``sync_leaves``, in the order the blocks were packed.
  """
  offsets = dict.fromkeys(buffers, 0)
  out = {}
  for leaf in leaves:
    start = offsets[leaf.buffer]
    out[leaf.key] = buffers[leaf.buffer][..., start:start + leaf.block]
    offsets[leaf.buffer] += leaf.block
  return out


def synced_loss(buffers: dict[str, jax.Array], per_replica: bool = False) -> jax.Array:
  """The job's loss from a class's synced buffers (``[replicas, degree, L]``): any core
  position holds the sum over every live replica. ``per_replica``: f32 ``[replicas]``, each
  replica's own reading (all equal; no value crosses replicas)."""
  return buffers[LOSS_DTYPE][:, 0, -1] if per_replica else buffers[LOSS_DTYPE][0, 0, -1]


@dataclasses.dataclass(frozen=True)
class OuterShards:
  """A class buffer as ``CrossClassSync.unstack`` reads it: its global shape and sharding,
  and this process's shards at positions beyond ``t_min`` (``device -> array``)."""

  shape: tuple[int, ...]
  sharding: jax.sharding.Sharding
  shards: dict


class CrossClassSync:
  """Phase 2: all-reduce of the core slots' flat buffers over every live replica.

  A few buffers per device (one per dtype and stack of layers): the host-side
  work per step is a few calls per local device, whatever the parameter count. In a multi-process
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
    self.local = holds_mine(self.mesh)
    self._all_reduce = jax.jit(jax.shard_map(
        lambda x: jax.lax.psum(x, REPLICA), mesh=self.mesh,
        in_specs=P(REPLICA, PEER), out_specs=P(REPLICA, PEER)))

  def _stacked_shape(self, array) -> tuple[int, ...]:
    """The all-reduce's argument for one buffer: ``[live replicas, t_min, L]`` (stacked
    parameters': ``[live replicas, t_min, layers, L]``)."""
    return (self.mesh.devices.shape[0], self.t_min, *array.shape[2:])

  def lower(self, class_blocks: list[dict[str, jax.ShapeDtypeStruct]]) -> jax.stages.Lowered:
    """The all-reduce program, lowered for the classes' abstract sync buffers
    (``steps.abstract_sync_blocks``): compiling it ahead makes the first call compile nothing."""
    return self._all_reduce.lower({
        name: jax.ShapeDtypeStruct(self._stacked_shape(array), array.dtype,
                                   sharding=self.sharding)
        for name, array in class_blocks[0].items()})

  def stack(self, class_buffers: list[dict | None], sharding: NamedSharding | None = None
            ) -> dict[str, jax.Array] | None:
    """The core devices' buffers as one array per buffer name, ``[live replicas, t_min, ...,
    L]``, no copy.

    Args:
      class_buffers: per class, ``name -> [replicas, degree, ..., L]`` arrays
        (``P('dp', 'tp')`` on the class mesh), or None for a class with no
        device in this process.
      sharding: of the result over the same devices in the same order (default
        ``P('replica', 'peer')`` on the sync mesh).

    Returns:
      None when this process holds no core device.
    """
    if not self.local:
      return None
    first = next(b for b in class_buffers if b is not None)
    by_device: dict[str, dict[jax.Device, jax.Array]] = {name: {} for name in first}
    for buffers in class_buffers:
      for name, array in (buffers or {}).items():
        by_device[name].update((s.device, s.data) for s in array.addressable_shards)
    held = mine(self.mesh)
    return {name: jax.make_array_from_single_device_arrays(
        self._stacked_shape(array), sharding or self.sharding, [by_device[name][d] for d in held])
        for name, array in first.items()}

  def outer(self, class_buffers: list[dict | None]) -> list[dict | None]:
    """What ``unstack`` reads of ``class_buffers``: each buffer's shape, sharding and its
    shards at positions beyond ``t_min`` (``OuterShards``), so that the core positions'
    shards can be freed before the buffers are unstacked."""
    out: list[dict | None] = []
    for c, buffers in enumerate(class_buffers):
      if buffers is None:
        out.append(None)
        continue
      outer_devices = {d for row in self.meshes[c].devices for d in row[self.t_min:]}
      out.append({name: OuterShards(array.shape, array.sharding,
                                    {s.device: s.data for s in array.addressable_shards
                                     if s.device in outer_devices})
                  for name, array in buffers.items()})
    return out

  def unstack(self, class_buffers: list[dict | None],
              stacked: dict[str, jax.Array] | None) -> list[dict | None]:
    """Inverse of ``stack``: ``class_buffers`` (arrays, or their ``outer``) with their core
    positions taken from ``stacked`` (positions beyond ``t_min`` keep theirs: they hold no
    data), no copy."""
    core: dict[str, dict[jax.Device, jax.Array]] = {
        name: {s.device: s.data for s in array.addressable_shards}
        for name, array in (stacked or {}).items()}
    out: list[dict | None] = []
    for c, buffers in enumerate(class_buffers):
      if buffers is None:
        out.append(None)
        continue
      synced = {}
      for name, array in buffers.items():
        own = (array.shards if isinstance(array, OuterShards)
               else {s.device: s.data for s in array.addressable_shards})
        pieces = []
        for row in self.meshes[c].devices:
          for j, device in enumerate(row):
            if is_mine(device):
              pieces.append(core[name][device] if j < self.t_min else own[device])
        synced[name] = jax.make_array_from_single_device_arrays(array.shape, array.sharding,
                                                                pieces)
      out.append(synced)
    return out

  def __call__(self, class_buffers: list[dict | None]) -> list[dict | None]:
    """Sum each buffer over all live replicas.

    Args:
      class_buffers: per class, ``name -> [replicas, degree, ..., L]`` arrays
        (``P('dp', 'tp')`` on the class mesh), or None for a class with no
        device in this process.

    Returns:
      The same structure with core positions replaced by the all-reduced
      buffers (positions beyond ``t_min`` keep theirs: they hold no data).
    """
    stacked = self.stack(class_buffers)
    # One program for every dtype.
    return self.unstack(class_buffers, None if stacked is None else self._all_reduce(stacked))


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
    regroups = plan_regroups(plan, abstract_params_by_class)
  intra = cross = logical = 0
  for c, state in zip(plan.classes, abstract_params_by_class):
    for leaf in sync_leaves(state, c.degree, t_min, regroups):
      intra += leaf.intra_domain_bytes(len(c.replicas), itemsize)
      if c.index == 0:
        logical += leaf.numel * itemsize
        cross += int(2 * (live - 1) / live * leaf.position_size * itemsize) * t_min * live
  return {"intra_domain": intra, "cross_replica": cross, "logical": logical}
