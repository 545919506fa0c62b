"""A sharded optimizer state read back by the replicas left after a lost process.

``zero.ShardedOptimizer`` gives its state back in the class layout with programs over
every device of the plan; once a process is lost, no program may touch its devices. The
survivors (the replicas whose devices all lie in live processes, ``programs.live_rows``)
rebuild it among themselves when every piece still has a holder among them
(``train.optimizer_copies`` >= 2):

1. one program over the survivors' core devices, a ``('member', 'peer')`` mesh: the
   first surviving holder of each piece places its bits in a zeroed buffer at the
   piece's offset, the others give zeros, and a ``psum`` over ``'member'`` (as unsigned
   integers: every bit kept, ``-0.0`` too) gives each survivor the whole buffer of its
   peer group;
2. each surviving class unpacks the buffers into its layout on the mesh of its surviving
   rows (``SplitStep.unpack_over``, its parameters giving the layout: their values are
   not read); the positions past ``t_min`` are host zeros.

Nothing is compiled on the way when ``lower`` ran ahead (the same programs, abstract
arguments). A piece whose holders were all lost raises ``LookupError`` (the restart path).
Source: Rajbhandari et al., ZeRO (arXiv:1910.02054), a partition's replicas as its
redundancy; the NTP peer groups (Arfeen et al., arXiv:2504.06095, Sec. 4.2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optax import tree_utils

from ntp_jax.parallel.master_weights import MASTER
from ntp_jax.parallel.programs import ClassProgram, keep_rows
from ntp_jax.parallel.zero import (
  MASTER_DTYPE,
  PEER,
  ShardedOptimizer,
  as_dtype,
  fill_class_state,
  replicated_scalar,
)
from ntp_jax.sharding.mesh import DP, TP
from ntp_jax.sharding.topology import holds_mine, is_mine, mine

MEMBER = "member"  # axis of the survivors' mesh: a surviving replica's core slots
SURVIVOR_SPEC = P(MEMBER, PEER)


def surviving_rows(optimizer: ShardedOptimizer, survivors: Sequence[ClassProgram],
                   dead: Collection[jax.Device] = frozenset()) -> list[int]:
  """The rows of the sync mesh (live replicas, in class order) that are whole among
  ``survivors`` (the class programs cut to the live processes' rows) and hold no dead
  device."""
  kept = {tuple(row) for p in survivors for row in p.mesh.devices}
  out = []
  r = 0
  for mesh in optimizer.sync.meshes:
    for row in mesh.devices:
      if tuple(row) in kept and not set(row) & set(dead):
        out.append(r)
      r += 1
  return out


def piece_givers(optimizer: ShardedOptimizer, rows: Sequence[int]) -> tuple[int, ...]:
  """Per surviving row (``rows`` of the sync mesh), the piece it gives the gathering, or
  -1 where an earlier row gives the same piece. Row ``r`` holds piece ``r % pieces``
  (``ShardedOptimizer``'s ``('copy', 'piece', 'peer')`` grid).

  Raises:
    LookupError: a piece has no surviving holder (one line).
  """
  given, out = set(), []
  for r in rows:
    piece = r % optimizer.pieces
    out.append(-1 if piece in given else piece)
    given.add(piece)
  missing = sorted(set(range(optimizer.pieces)) - given)
  if missing:
    raise LookupError(
        f"optimizer state piece {missing[0]} (of every peer group) was held only by replicas "
        f"of lost processes (train.optimizer_copies={optimizer.settings.copies})")
  return tuple(out)


def _gather_fn(pieces: dict, *, givers: tuple[int, ...], pieces_per_group: int,
               lengths: tuple[tuple[str, tuple[int, ...]], ...], mesh: Mesh) -> dict:
  """``name -> [members, t_min, ..., n]`` float32 pieces -> every member's whole buffers
  ``[members, t_min, ..., L]``, each piece from its giver (``piece_givers``); ``lengths``:
  each buffer's shape past ``[members, t_min]``."""
  length, table = {k: shape[-1] for k, shape in lengths}, np.asarray(givers, np.int32)

  def body(local):
    piece = jnp.asarray(table)[jax.lax.axis_index(MEMBER)]
    out = {}
    for name, x in local.items():  # x: [1, 1, ..., n]
      n = x.shape[-1]
      bits = jax.lax.bitcast_convert_type(x[0, 0], jnp.uint32)
      placed = jax.lax.dynamic_update_slice_in_dim(
          jnp.zeros((*bits.shape[:-1], n * pieces_per_group), jnp.uint32), bits,
          jnp.maximum(piece, 0) * n, bits.ndim - 1)
      whole = jax.lax.psum(jnp.where(piece >= 0, placed, jnp.zeros_like(placed)), MEMBER)
      out[name] = jax.lax.bitcast_convert_type(whole[..., :length[name]],
                                               MASTER_DTYPE)[None, None]
    return out

  return jax.shard_map(body, mesh=mesh, in_specs=(SURVIVOR_SPEC,),
                       out_specs=SURVIVOR_SPEC)(pieces)


_gather = jax.jit(_gather_fn,
                  static_argnames=("givers", "pieces_per_group", "lengths", "mesh"))


class SurvivorRebuild:
  """The programs that give the class layout's optimizer state to the replicas left after
  a lost process (see the module docstring).

  Args:
    optimizer: the plan's ``ShardedOptimizer``.
    programs: the plan's class programs (steps on this process's classes).
    survivors: ``programs`` cut to the live processes' rows (``programs.live_rows``): their
      meshes, and their parameters as the unpacking's layout (values not read).
    dead: devices that must not be read besides the lost processes'.

  Raises:
    LookupError: a piece has no surviving holder (``piece_givers``).
  """

  def __init__(self, optimizer: ShardedOptimizer, programs: Sequence[ClassProgram],
               survivors: Sequence[ClassProgram], dead: Collection[jax.Device] = frozenset()):
    self.optimizer, self.programs, self.survivors = optimizer, list(programs), list(survivors)
    self.rows = surviving_rows(optimizer, survivors, dead)
    self.givers = piece_givers(optimizer, self.rows)
    self.mesh = Mesh(optimizer.sync.mesh.devices[self.rows], (MEMBER, PEER))
    self.local = holds_mine(self.mesh)
    by_class = {p.replica_class: p for p in programs}
    self.originals = [by_class[s.replica_class] for s in survivors]

  # -- the gathering --------------------------------------------------------------------------

  def _cut(self, array: jax.Array) -> jax.Array:
    """A piece leaf ``[live replicas, t_min, n]`` -> its surviving rows' ``[members, t_min,
    n]`` over ``self.mesh``, no copy."""
    by_device = {s.device: s.data for s in array.addressable_shards}
    shape = (len(self.rows),) + tuple(array.shape[1:])
    return jax.make_array_from_single_device_arrays(
        shape, NamedSharding(self.mesh, SURVIVOR_SPEC), [by_device[d] for d in mine(self.mesh)])

  def _gathered(self, pieces: dict, lengths: tuple[tuple[str, tuple[int, ...]], ...]) -> dict:
    return _gather({k: self._cut(v) for k, v in pieces.items()}, givers=self.givers,
                   pieces_per_group=self.optimizer.pieces, lengths=lengths, mesh=self.mesh)

  # -- per surviving class ----------------------------------------------------------------------

  def _buffers(self, survivor: ClassProgram, whole: dict | None,
               lengths: tuple[tuple[str, tuple[int, ...]], ...]) -> dict:
    """The class's float32 sync buffers ``name -> [rows, degree, ..., L]`` on its surviving
    mesh: core positions from ``whole`` (the gathering's), the others host zeros."""
    t_min = self.optimizer.sync.t_min
    sharding = NamedSharding(survivor.mesh, P(DP, TP))
    rows, degree = survivor.mesh.devices.shape
    out = {}
    for name, shape in lengths:
      core = {} if whole is None else {s.device: s.data for s in whole[name].addressable_shards}
      shards = []
      for row in survivor.mesh.devices:
        for j, device in enumerate(row):
          if is_mine(device):
            shards.append(core[device] if j < t_min else
                          jax.device_put(np.zeros((1, 1, *shape), np.float32), device))
      out[name] = jax.make_array_from_single_device_arrays((rows, degree, *shape), sharding,
                                                           shards)
    return out

  def _lengths(self, survivor: ClassProgram) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``(name, shape past [rows, degree])`` of the sync buffers (the same in every class)."""
    original = self.originals[self.survivors.index(survivor)]
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          original.params)
    return tuple(sorted((k, tuple(v.shape[2:])) for k, v in
                        jax.eval_shape(original.step.pack, params).items()))

  def opt_states(self, state: dict | None, shapes: Sequence[Any], count: int) -> list[Any]:
    """Each surviving class's optimizer state in the class layout on its surviving rows
    (abstract for a class of another process), as ``ShardedOptimizer.class_opt_states``
    gives it on the whole plan.

    Args:
      state: the sharded state (None in a process with no core device).
      shapes: the abstract class-layout optimizer state of each of ``programs``.
      count: the optimizer's step count (host int, the same in every process).
    """
    by_class = {p.replica_class: s for p, s in zip(self.programs, shapes)}
    cut_shapes = [_cut_shapes(s, o, by_class[s.replica_class])
                  for s, o in zip(self.survivors, self.originals)]
    first = next((s for s in self.survivors if holds_mine(s.mesh)), None)
    if first is None:
      return cut_shapes
    names = [MASTER] if self.optimizer._with_master(shapes) else []
    names += list(self.optimizer.fields)
    lengths = self._lengths(first)
    trees = {}
    for name in names:
      whole = None
      if self.local:
        pieces = state["master"] if name == MASTER else tree_utils.tree_get(state["opt"], name)
        whole = self._gathered(pieces, lengths)
      trees[name] = [
          original.step.unpack_over(s.mesh)(self._buffers(s, whole, lengths), s.params)
          if holds_mine(s.mesh) else None for s, original in zip(self.survivors, self.originals)]
    out = []
    for i, (survivor, shape) in enumerate(zip(self.survivors, cut_shapes)):
      if not holds_mine(survivor.mesh):
        out.append(shape)
        continue
      out.append(fill_class_state(
          shape, {f: trees[f][i] for f in self.optimizer.fields},
          trees[MASTER][i] if MASTER in trees else None,
          replicated_scalar(count, NamedSharding(survivor.mesh, P())),
          self.optimizer.settings.name))
    return out

  def params(self, state: dict | None) -> list[Any]:
    """Each surviving class's parameters from the master weights' pieces, in the
    parameters' dtypes, on its surviving rows (None for a class of another process): for a
    process lost after a committed update, before the parameters were unpacked
    (``sharded_step.ShardedJobStep.params_behind``)."""
    first = next((s for s in self.survivors if holds_mine(s.mesh)), None)
    if first is None:
      return [None] * len(self.survivors)
    lengths = self._lengths(first)
    whole = self._gathered(state["master"], lengths) if self.local else None
    return [jax.tree.map(as_dtype, original.step.unpack_over(s.mesh)(
                self._buffers(s, whole, lengths), s.params), s.params)
            if holds_mine(s.mesh) else None for s, original in zip(self.survivors,
                                                                     self.originals)]

  def lower(self, state: Any, shapes: Sequence[Any]) -> list[tuple[str, jax.stages.Lowered]]:
    """The programs ``opt_states`` runs, lowered for abstract arguments (``state``: the
    sharded state's shapes, None in a process with no core device), for compiling ahead
    of the loss. ``(what, lowered)`` each."""
    first = next((s for s in self.survivors if holds_mine(s.mesh)), None)
    if first is None:
      return []
    lengths = self._lengths(first)
    out = []
    if self.local:
      pieces = {k: jax.ShapeDtypeStruct((len(self.rows),) + tuple(v.shape[1:]), v.dtype,
                                        sharding=NamedSharding(self.mesh, SURVIVOR_SPEC))
                for k, v in state["master"].items()}
      out.append(("optimizer state read back by survivors (gather)", _gather.lower(
          pieces, givers=self.givers, pieces_per_group=self.optimizer.pieces, lengths=lengths,
          mesh=self.mesh)))
    for survivor, original in zip(self.survivors, self.originals):
      if holds_mine(survivor.mesh):
        rows, degree = survivor.mesh.devices.shape
        sharding = NamedSharding(survivor.mesh, P(DP, TP))
        blocks = {k: jax.ShapeDtypeStruct((rows, degree, *shape), np.float32,
                                          sharding=sharding) for k, shape in lengths}
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                             sharding=x.sharding),
                              survivor.params)
        out.append(("optimizer state read back by survivors (unpack)",
                    original.step.unpack_over(survivor.mesh).lower(blocks, params)))
    return out


def _cut_shapes(survivor: ClassProgram, original: ClassProgram, shape: Any) -> Any:
  """The class layout's abstract optimizer state ``shape`` on ``survivor``'s rows of
  ``original`` (``programs.keep_rows``)."""
  kept = {tuple(row) for row in survivor.mesh.devices}
  rows = [i for i, row in enumerate(original.mesh.devices) if tuple(row) in kept]
  return keep_rows(dataclasses.replace(original, opt_state=shape), rows,
                   shapes_only=True).opt_state
