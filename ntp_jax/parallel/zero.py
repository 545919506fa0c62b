"""ZeRO-1 and ZeRO-2 under NTP: the optimizer state (and, with ZeRO-2, the reduced
gradients) split over the replicas of each peer group.

After the sync's phase 1 (``sync.to_sync_blocks``, ``sync.pack_buffers``) core
slot ``j`` of every live replica, whatever its TP degree, holds its gradient
in the same layout: one buffer per dtype (and stack of layers), ``L``
elements (``[layers, L]``), every logical element at exactly one position
``j``. The replicas of peer group ``j`` split each buffer along ``L`` into
``P`` pieces (``piece_count``; every layer alike); replica ``r`` holds piece
``r % P``, so each piece is held by ``R / P >= copies`` replicas. Per piece a
device keeps float32 master weights and the fields of the optax rule's state shaped as
the parameters (``moment_fields``: AdamW's moments, a momentum trace; float32, following
the master weights); which elements decay is a static
property of the layout (``decay_runs``), computed in the program; devices past
the core slots keep none.

One step, over a ``('copy', 'piece', 'peer')`` mesh of the core devices, in four
programs, so that what consumes the state runs no collective across processes
(``job_step``: a step that commits votes between them, ``processes.commit``):

1. ``reduce``: reduce-scatter of the gradient buffers over ``'piece'``, then an
   all-reduce of the piece over ``'copy'`` (nothing with one copy): collectives
   among the replicas of each peer group only. Where both groupings hold several
   replicas (``1 < copies < replicas``) these are two programs (``reduce_in_two``:
   the reduce-scatter, then the sum over the copies);
2. ``norm``: the global norm of the pieces (each logical element once) and the
   job's loss, one all-reduce over ``('piece', 'peer')``;
3. ``update``: the clipping by the norm and the optimizer's update of each piece
   (the trainer's AdamW without its decay mask, the decayed elements' runs
   applied in the program), the state donated, with no collective;
4. ``gather_params``: all-gather of the updated master weights over ``'piece'``,
   in the parameters' dtype; each class unpacks them into its blocks
   (``steps.SplitStep.unpack``).

Each program's collectives group the devices one way (the norm's apart from the
reduction's, the reduction's two groupings apart where ``reduce_in_two``), so a peer
lost inside one leaves half-entered only collectives whose group holds the lost device:
none that a later plan reuses (``processes.commit``).

With one copy the bytes across domains are a reduce-scatter and an
all-gather of the buffer: an all-reduce's.

ZeRO-2 (``ZeroSettings.stage=2``) runs step 1 per micro-batch instead: each
class's gradient half runs one micro-batch (``steps.SplitStep.micro_grad``)
and its buffers are reduce-scattered at once and added to float32 pieces
(``reduce`` with the running sum), so no device
carries a whole step's gradient. Each micro-batch sends a reduce-scatter:
with ``m`` micro-batches, ``m`` reduce-scatters and one all-gather per step
(with ``m = 1``, zero1's bytes).

A failed device's pieces are taken from another copy
(``class_opt_states`` with ``dead``); with no live copy left, or only one in
another process, ``LookupError`` (the restart path). After a lost process the
survivors read the state back among themselves (``zero_survivors``). In a
multi-process job a process with no core device runs none of these programs
(its state is None) and only its classes' ones.
Checkpoints, live peers and every other reader see the optimizer state in
the class layout (``class_opt_states``), so they stay logical and
plan-independent.
Source: Rajbhandari et al., ZeRO (arXiv:1910.02054), stages 1 (optimizer
state partitioned over data-parallel ranks) and 2 (gradients too), over the
NTP peer groups
(Arfeen et al., arXiv:2504.06095, Sec. 4.2).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from optax import tree_utils

from ntp_jax.parallel.master_weights import MASTER
from ntp_jax.parallel.sync import LOSS_DTYPE, CrossClassSync
from ntp_jax.parallel.sync_leaf import buffer_dtype
from ntp_jax.sharding.topology import holds_mine

COPY = "copy"  # axis of the piece mesh: the replicas holding one piece
PIECE = "piece"  # axis of the piece mesh: which piece of the peer group's buffer
PEER = "peer"  # axis of the piece mesh: core slot position (peer group)
PIECE_SPEC = P((COPY, PIECE), PEER)  # a ``[live replicas, t_min, ...]`` array over the mesh
MASTER_DTYPE = jnp.float32  # master weights and the moments that follow them
UPDATE_PROGRAM = "sharded optimizer (update)"  # ``lower_step``'s name of the update


def piece_count(replicas: int, copies: int) -> int:
  """Pieces a peer group's buffer is cut into: the largest divisor ``P`` of ``replicas``
  with ``replicas / P >= copies`` (each piece held by that many replicas).

  Raises:
    ValueError: ``copies`` is not between 1 and ``replicas``.
  """
  if not 1 <= copies <= replicas:
    raise ValueError(f"{copies} copies of each optimizer piece need 1 to {replicas} (the live "
                     "replicas)")
  # replicas // P >= copies  <=>  P <= replicas // copies: the first divisor from there down.
  return next(p for p in range(replicas // copies, 0, -1) if replicas % p == 0)


@dataclasses.dataclass(frozen=True)
class ZeroSettings:
  """What the sharded optimizer needs; hashable, so it keys its programs in a cache.

  Attributes:
    optimizer: the update rule applied to each flat piece (the trainer's AdamW
      with no decay mask: the decayed elements are the ``decay_runs`` instead).
    decay_mask: ``params -> tree of bool`` (``True``: the parameter decays), the
      mask the replicated optimizer uses.
    clip_norm: clip the global gradient norm to this (0: off).
    copies: replicas holding each piece (``train.optimizer_copies``).
    stage: 1 (``zero1``: each micro-batch's gradient summed into a full buffer on the
      device, reduce-scattered once per step) or 2 (``zero2``: each micro-batch's
      gradient reduce-scattered at once into a float32 piece, so no device holds a
      whole step's gradient).
  """

  optimizer: optax.GradientTransformation
  decay_mask: Callable[[Any], Any]
  clip_norm: float
  copies: int = 1
  stage: int = 1

  @property
  def name(self) -> str:
    """``zero1`` or ``zero2`` (``train.optimizer_sharding``)."""
    return f"zero{self.stage}"


DecayRuns = tuple[tuple[str, tuple[tuple[int, int], ...]], ...]


def decay_runs(leaves: Sequence[Any], decays: Sequence[bool]) -> DecayRuns:
  """Where the decayed parameters lie along each sync buffer: ``name -> ((start, stop),
  ...)``, adjacent runs merged (the same at every core position: every parameter's
  ``SyncLeaf.block`` is).

  Args:
    leaves: a class's ``sync_leaf.sync_leaves`` (the order ``sync.pack_buffers`` packs).
    decays: per leaf, whether its parameter decays (``ZeroSettings.decay_mask``).
  """
  runs: dict[str, list[list[int]]] = {}
  offsets: dict[str, int] = {}
  for leaf, decayed in zip(leaves, decays, strict=True):
    start = offsets.get(leaf.buffer, 0)
    offsets[leaf.buffer] = start + leaf.block
    if not decayed or not leaf.block:
      continue
    mine_runs = runs.setdefault(leaf.buffer, [])
    if mine_runs and mine_runs[-1][1] == start:
      mine_runs[-1][1] = start + leaf.block
    else:
      mine_runs.append([start, start + leaf.block])
  return tuple(sorted((name, tuple(map(tuple, r))) for name, r in runs.items()))


def runs_of(leaves: Sequence[Any], settings: ZeroSettings, params: Any) -> DecayRuns:
  """``decay_runs`` of a class: its ``SplitStep.leaves`` and its parameters (replica-stacked,
  arrays or ``jax.ShapeDtypeStruct``s), whose ``settings.decay_mask`` says which decay."""
  return decay_runs(leaves, [bool(v.get_value())
                             for _, v in nnx.to_flat_state(settings.decay_mask(params))])


def moment_fields(optimizer: optax.GradientTransformation) -> tuple[str, ...]:
  """The fields of ``optimizer``'s state that hold a tree shaped as its parameters (Adam's
  ``mu`` and ``nu``, a momentum ``trace``, ...), by name, in the state's order: what the
  sharded optimizer cuts into pieces beside the master weights. Found from the state of a
  one-matrix probe (``jax.eval_shape``: nothing allocated). The rule must act element by
  element, as on the flat pieces: a state shaped otherwise (a factored moment) is refused.

  Raises:
    ValueError: a field name that two parts of the state share (a piece is found by its
      name), or a state leaf that is neither shaped as the parameters nor a scalar (a
      factored moment: it cannot be cut like the parameters); one line naming it.
  """
  probe = {"probe": jax.ShapeDtypeStruct((4, 6), MASTER_DTYPE)}
  shaped = jax.tree.structure(probe)
  found: list[str] = []

  def like_params(value: Any) -> bool:
    return (jax.tree.structure(value) == shaped
            and all(getattr(x, "shape", None) == (4, 6) for x in jax.tree.leaves(value)))

  def walk(node: Any, where: str) -> None:
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # an optax state NamedTuple
      for name, value in zip(node._fields, node):
        if name != MASTER and like_params(value):
          if name in found:
            raise ValueError(f"the optimizer state has two fields named {name!r}: the "
                             "sharded optimizer finds its pieces by name")
          found.append(name)
        else:
          walk(value, f"{where}.{name}")
    elif isinstance(node, (tuple, list)):
      for i, value in enumerate(node):
        walk(value, f"{where}[{i}]")
    elif isinstance(node, dict):
      for key, value in node.items():
        walk(value, f"{where}[{key!r}]")
    elif node is not None and getattr(node, "ndim", 0) > 0:
      raise ValueError(f"optimizer state leaf {where} of shape {tuple(node.shape)} is neither "
                       "shaped as the parameters nor a scalar: the sharded optimizer cannot "
                       "cut it into pieces")

  walk(jax.eval_shape(optimizer.init, probe), "state")
  return tuple(found)


def step_count(state: Any) -> Any:
  """The optimizer state's step count (its first ``count`` leaf), or None for a state that
  keeps none (plain SGD with momentum)."""
  found = tree_utils.tree_get_all_with_path(state, "count")
  return found[0][1] if found else None


def _with_count(state: Any, count: Any, **fields: Any) -> Any:
  """``state`` with ``fields`` set, and every ``count`` leaf too where it keeps one."""
  if count is not None and step_count(state) is not None:
    fields["count"] = count
  return tree_utils.tree_set(state, **fields) if fields else state


def piece_elements(shape: Sequence[int], pieces: int) -> int:
  """Elements of one piece of a sync buffer of one position's ``shape`` (``(L,)`` or
  ``(layers, L)``) cut into ``pieces`` along its last axis."""
  return int(np.prod(shape[:-1], dtype=np.int64)) * -(-shape[-1] // pieces)


def _lead(x):
  """Inside the body: a piece ``[..., piece]`` -> its block ``[1, 1, ..., piece]`` (scalars
  stay)."""
  return x[None, None] if x.ndim else x


def _unlead(x):
  return x[0, 0] if x.ndim else x


def _lengths(buffers: dict) -> tuple[tuple[str, int], ...]:
  """Each buffer's ``L`` (its last axis), as a static argument."""
  return tuple(sorted((name, x.shape[-1]) for name, x in buffers.items()))


def as_dtype(x, like):
  """``x`` in ``like``'s dtype (no program when it has it already)."""
  return x if x.dtype == like.dtype else x.astype(like.dtype)


def _pad_last(x: jax.Array, length: int) -> jax.Array:
  """``x`` padded with zeros to ``length`` along its last axis."""
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, length - x.shape[-1])])


def replicated_scalar(value: Any, sharding: NamedSharding) -> jax.Array:
  """A host scalar as a replicated array over ``sharding``'s devices (which may span
  processes: each process places its own copies)."""
  host = np.asarray(value)
  return jax.make_array_from_callback((), sharding, lambda _: host)


def _specs(tree):
  return jax.tree.map(lambda x: PIECE_SPEC if x.ndim else P(), tree)


class ShardedOptimizer:
  """The programs of ZeRO-1/2 over a plan's peer groups (stateless: the state is passed in).

  Args:
    sync: the plan's ``sync.CrossClassSync`` (its core devices and their assembly).
    settings: a ``ZeroSettings``.
    runs: where the decayed parameters lie in the buffers (``decay_runs``).

  With fewer live replicas than ``settings.copies`` (failures dropped replicas), every
  live replica holds every piece.
  """

  def __init__(self, sync: CrossClassSync, settings: ZeroSettings, runs: DecayRuns):
    self.sync, self.settings, self.runs = sync, settings, dict(runs)
    self.fields = moment_fields(settings.optimizer)  # cut into pieces beside the master
    replicas, t_min = sync.mesh.devices.shape
    self.pieces = piece_count(replicas, min(settings.copies, replicas))
    grid = sync.mesh.devices.reshape(replicas // self.pieces, self.pieces, t_min)
    self.mesh = Mesh(grid, (COPY, PIECE, PEER))
    self.sharding = NamedSharding(self.mesh, PIECE_SPEC)
    # One grouping of the devices per program (``processes.commit``): the reduce-scatter
    # over a copy's replicas and the all-reduce over the copies are two programs where
    # both groups hold several devices.
    self.reduce_in_two = self.pieces > 1 and grid.shape[0] > 1
    self._scatter = jax.jit(self._scatter_fn)
    self._gather = jax.jit(self._gather_fn, static_argnames=("lengths", "cast"))
    self._gather_live = jax.jit(self._gather_live_fn, static_argnames=("lengths",))
    self._start = jax.jit(self._start_fn)
    self._reduce = jax.jit(self._reduce_fn, donate_argnums=(1,),
                           static_argnames=("lengths", "last", "scattered"))
    self._scatter_round = jax.jit(self._scatter_round_fn)
    self._norm = jax.jit(self._norm_fn)
    self._update = jax.jit(self._update_fn, donate_argnums=(2,))

  # -- the programs ---------------------------------------------------------------------------

  def _map(self, body, in_specs, out_specs, *args):
    return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)(*args)

  def _scatter_fn(self, buffers: dict) -> dict:
    """``name -> [R, t_min, ..., L]`` -> each device's piece ``[R, t_min, ..., ceil(L / P)]``,
    float32 (stacked parameters' buffers are cut along ``L``, every layer alike)."""

    def body(local):
      out = {}
      for name, x in local.items():  # x: [1, 1, ..., L]
        n = -(-x.shape[-1] // self.pieces)
        padded = _pad_last(x[0, 0], n * self.pieces).astype(MASTER_DTYPE)
        out[name] = _lead(jax.lax.dynamic_slice_in_dim(
            padded, jax.lax.axis_index(PIECE) * n, n, axis=-1))
      return out

    return self._map(body, (PIECE_SPEC,), PIECE_SPEC, buffers)

  def _gather_fn(self, pieces: dict, lengths: tuple[tuple[str, int], ...],
                 cast: bool = False) -> dict:
    """Inverse of ``_scatter_fn``: every core device gets the whole ``[L]`` buffer, in
    float32 (master weights and moments keep every bit), or with ``cast`` in each buffer's
    own dtype (the parameters, from the master weights)."""
    length = dict(lengths)

    def body(local):
      out = {}
      for name, x in local.items():
        x = x[0, 0].astype(buffer_dtype(name)) if cast else x[0, 0]
        out[name] = _lead(jax.lax.all_gather(x, PIECE, axis=x.ndim - 1, tiled=True)
                          [..., :length[name]])
      return out

    return self._map(body, (PIECE_SPEC,), PIECE_SPEC, pieces)

  def _gather_live_fn(self, pieces: dict, givers: jax.Array,
                      lengths: tuple[tuple[str, int], ...]) -> dict:
    """``_gather_fn`` with each piece read from one chosen holder: ``givers`` (int32
    ``[R, t_min]``, ``live_givers``) is 1 on the device that gives its piece to its
    ``'copy'`` group. The givers' bits, summed over ``'copy'`` as unsigned integers with
    zeros from the others, come back exactly (``-0.0`` and NaN payloads too), whichever
    process holds them."""
    length = dict(lengths)

    def body(local, give):
      out = {}
      for name, x in local.items():  # x: [1, 1, ..., n]
        bits = jax.lax.bitcast_convert_type(x[0, 0], jnp.uint32)
        bits = jax.lax.psum(jnp.where(give[0, 0] > 0, bits, jnp.zeros_like(bits)), COPY)
        piece = jax.lax.bitcast_convert_type(bits, MASTER_DTYPE)
        out[name] = _lead(jax.lax.all_gather(piece, PIECE, axis=piece.ndim - 1, tiled=True)
                          [..., :length[name]])
      return out

    return self._map(body, (PIECE_SPEC, PIECE_SPEC), PIECE_SPEC, pieces, givers)

  def live_givers(self, dead: Collection[jax.Device]) -> jax.Array:
    """int32 ``[R, t_min]`` over the piece mesh: 1 on each piece's first holder (in
    ``'copy'`` order) outside ``dead``, 0 elsewhere (``_gather_live_fn``). Every piece must
    have such a holder (``_check_copies_reachable``)."""
    grid = self.mesh.devices
    table = np.zeros(grid.shape, np.int32)
    for p, j in np.ndindex(grid.shape[1:]):
      c = next(c for c in range(grid.shape[0]) if grid[c, p, j] not in dead)
      table[c, p, j] = 1
    table = table.reshape(-1, grid.shape[2])  # row c * pieces + p: PIECE_SPEC's order
    return jax.make_array_from_callback(table.shape, self.sharding, lambda i: table[i])

  def _start_fn(self, params: dict, moments: tuple[dict, ...], count: jax.Array) -> dict:
    """The sharded state from the class layout's (already packed and cut into pieces):
    ``moments`` holds the pieces of each of ``fields``, in order."""
    opt = _with_count(self.settings.optimizer.init(params), count,
                      **dict(zip(self.fields, moments, strict=True)))
    return {"master": params, "opt": opt}

  def _scatter_local(self, x: jax.Array) -> jax.Array:
    """Inside a body: this device's ``[1, 1, ..., L]`` buffer -> its piece summed over the
    replicas of its copy, ``[..., ceil(L / P)]`` in the buffer's dtype."""
    n = -(-x.shape[-1] // self.pieces)
    return jax.lax.psum_scatter(_pad_last(x[0, 0], n * self.pieces), PIECE,
                                scatter_dimension=x.ndim - 3, tiled=True)

  def _index(self, n: int) -> jax.Array:
    """Inside a body: the positions along ``L`` of this device's piece of ``n`` elements."""
    return jax.lax.axis_index(PIECE) * n + jnp.arange(n)

  def _reduce_fn(self, buffers: dict, total: dict | None, lengths: tuple, last: bool,
                 scattered: bool = False) -> dict | tuple[dict, dict]:
    """One round of gradient buffers (zero1: the step's; zero2: a micro-batch's) reduced
    into float32 pieces and added to ``total`` (the earlier rounds' sum; None: the first):
    collectives across the replicas of each peer group only (``_summed`` says what comes
    back; ``lengths``: the buffers' ``L``, ``_lengths``). ``scattered``: ``buffers`` are
    ``_scatter_round_fn``'s, and this is the second program, the sum over the copies."""

    def body(local, *earlier):
      summed = {name: jax.lax.psum(_unlead(x) if scattered else self._scatter_local(x),
                                   COPY).astype(MASTER_DTYPE) for name, x in local.items()}
      return self._summed(summed, earlier, lengths, last)

    ins = (PIECE_SPEC,) if total is None else (PIECE_SPEC, PIECE_SPEC)
    args = (buffers,) if total is None else (buffers, total)
    return self._map(body, ins, (PIECE_SPEC, PIECE_SPEC) if last else PIECE_SPEC, *args)

  def _scatter_round_fn(self, grads: dict) -> dict:
    """The first of a round's two programs where ``reduce_in_two``: each buffer
    reduce-scattered over the replicas of its copy (``'piece'``), in its dtype."""
    return self._map(lambda local: {name: _lead(self._scatter_local(x))
                                    for name, x in local.items()},
                     (PIECE_SPEC,), PIECE_SPEC, grads)

  def _summed(self, summed: dict, earlier: tuple, lengths: tuple, last: bool
              ) -> dict | tuple[dict, dict]:
    """Inside a body, after the reduction: the pieces plus ``earlier`` (``(total,)`` or
    empty). With ``last``, the pieces with their padding zeroed, and each device's ``loss``
    (the float32 buffer's last element where its piece holds it, on peer slot 0; else 0)
    and ``squares``, ``[live replicas, t_min]`` over the piece mesh, for ``_norm_fn``."""
    if earlier:
      summed = {name: _unlead(earlier[0][name]) + v for name, v in summed.items()}
    if not last:
      return jax.tree.map(_lead, summed)
    length = dict(lengths)
    g = {}
    for name, x in summed.items():
      # The float32 buffer ends with the replica's loss: no parameter of its own.
      data = length[name] - (1 if name == LOSS_DTYPE else 0)
      g[name] = jnp.where(self._index(x.shape[-1]) < data, x, 0)
    loss_piece = summed[LOSS_DTYPE]  # [n]: the loss buffer holds no stacked parameter
    at_loss = self._index(loss_piece.shape[-1]) == length[LOSS_DTYPE] - 1
    # Every peer slot's buffer carries the loss: slot 0's counts, once.
    loss = jnp.where(jax.lax.axis_index(PEER) == 0,
                     jnp.sum(jnp.where(at_loss, loss_piece, 0)), 0)
    squares = sum(jnp.sum(jnp.square(v)) for v in g.values())
    return jax.tree.map(_lead, g), {"loss": loss[None, None], "squares": squares[None, None]}

  def _norm_fn(self, sums: dict) -> dict:
    """The global gradient norm and the job's loss on every core device, float32 ``[live
    replicas, t_min]`` each (``{"grad_norm", "loss"}``), from each device's ``sums``
    (``_summed``): one all-reduce over the pieces and peer groups of each copy (each
    logical element counted once)."""

    def body(sums):
      total = jax.lax.psum(jnp.stack([sums["squares"], sums["loss"]]), (PIECE, PEER))
      return {"grad_norm": jnp.sqrt(total[0]), "loss": total[1]}

    return self._map(body, (PIECE_SPEC,), PIECE_SPEC, sums)

  def _update_fn(self, g: dict, norm: jax.Array, state: dict) -> dict:
    """The optimizer's update of each piece from the gradient pieces ``g`` (``_reduce_fn``
    with ``last``), clipped by ``norm`` (``_norm_fn``), the state donated: element by
    element, no collective."""

    def body(g, norm, state):
      g, state, norm = jax.tree.map(_unlead, g), jax.tree.map(_unlead, state), norm[0, 0]
      if self.settings.clip_norm:
        scale = jnp.where(norm > self.settings.clip_norm, self.settings.clip_norm / norm, 1.0)
        g = {name: v * scale for name, v in g.items()}
      master = state["master"]
      decayed = {}
      for name, x in master.items():
        index = self._index(x.shape[-1])
        decays = sum(((index >= a) & (index < b) for a, b in self.runs.get(name, ())),
                     start=jnp.zeros(index.shape, bool))
        decayed[name] = x * decays.astype(MASTER_DTYPE)
      updates, opt = self.settings.optimizer.update(g, state["opt"], decayed)
      return jax.tree.map(_lead, {"master": optax.apply_updates(master, updates), "opt": opt})

    specs = _specs(state)
    return self._map(body, (PIECE_SPEC, PIECE_SPEC, specs), specs, g, norm, state)

  # -- on the classes -------------------------------------------------------------------------

  def start(self, programs: Sequence[Any]) -> dict:
    """The sharded state from the class programs' parameters and optimizer state (the
    classes' ``SplitStep.pack``); each program's ``opt_state`` is then dropped (None).
    None in a process with no core device (it runs the classes' packing only).

    Raises:
      ValueError: the class optimizer's state lacks a field the sharded one keeps
        (``fields``): the two rules differ.
    """
    local = [holds_mine(p.mesh) for p in programs]
    if not any(local):
      raise ValueError("this process holds no device of the plan")
    first = programs[local.index(True)]
    count = step_count(first.opt_state)
    missing = [f for f in self.fields if tree_utils.tree_get(first.opt_state, f) is None]
    if missing:
      raise ValueError(f"train.optimizer_sharding={self.settings.name}: the class optimizer's "
                       f"state has no field {missing[0]!r}, which the sharded optimizer's "
                       "state holds (the two optimizers differ)")
    def packed(read):  # the class programs run in every process holding their devices
      stacked = self.sync.stack([p.step.pack(read(p)) if here else None
                                 for p, here in zip(programs, local)], self.sharding)
      return None if stacked is None else self._scatter(stacked)

    # Float32 master weights where the optimizer keeps them (parameters stored in less:
    # ``master_weights``), else the parameters.
    master = packed(lambda p: tree_utils.tree_get(p.opt_state, MASTER, p.params))
    moments = tuple(packed(lambda p, f=field: tree_utils.tree_get(p.opt_state, f))
                    for field in self.fields)
    state = None  # no core device here: the pieces live in other processes
    if self.sync.local:
      # The count through the host: the class mesh and the pieces' may span other processes.
      state = self._start(master, moments, None if count is None else replicated_scalar(
          np.asarray(count), NamedSharding(self.mesh, P())))
    for program in programs:
      program.opt_state = None
    return state

  def reduce(self, class_buffers: list[dict | None], total: dict | None = None, *,
             last: bool = True, phase: Callable[[str, Callable[[], Any]], Any] | None = None
             ) -> tuple[dict | None, dict | None]:
    """One round of the classes' gradient buffers reduced into the pieces (``reduce`` of the
    module docstring, less the norm: ``norm``).

    Args:
      class_buffers: per class, ``SplitStep.gradients``' buffers (zero2: one micro-batch's,
        ``micro_grad``; zeros for a class with no micro-batch left), None for a class of
        another process.
      total: the earlier rounds' sum (donated; None for the first round).
      last: the step's last round: the pieces come back with the per-device sums.
      phase: ``phase(suffix, run)`` runs each program (``run()``; a step that commits votes
        on each, in every process): ``""``, and where ``reduce_in_two`` then ``"_copies"``
        for the sum over the copies. Default: ``run()``.

    Returns:
      ``(pieces, sums)``: float32 ``[live replicas, t_min, ..., ceil(L / pieces)]`` per
      buffer; with ``last``, ``{"loss", "squares"}`` (float32 ``[live replicas, t_min]``
      over the piece mesh: each device's share of the job's loss and its sum of squares,
      for ``norm``), else None. Both None in a process with no core device.
    """
    phase = phase or (lambda _, run: run())

    def first():  # the reduction, or where it is two programs its reduce-scatter
      stacked = self.sync.stack(class_buffers, self.sharding)
      if stacked is None:
        return None
      if self.reduce_in_two:
        return self._scatter_round(stacked), _lengths(stacked)
      # The same arguments, ``scattered`` included, as ``lower_step`` lowers it with: one
      # cache entry, compiled ahead.
      return self._reduce(stacked, total, lengths=_lengths(stacked), last=last,
                          scattered=False)

    def copies(scattered):  # the sum over the copies
      return None if scattered is None else self._reduce(
          scattered[0], total, lengths=scattered[1], last=last, scattered=True)

    out = phase("", first)
    if self.reduce_in_two:
      out = phase("_copies", lambda: copies(out))
    return (None, None) if out is None else out if last else (out, None)

  def norm(self, sums: dict | None) -> dict[str, jax.Array] | None:
    """``{"grad_norm", "loss"}``: the global gradient norm and the job's loss, float32
    ``[live replicas, t_min]`` (the same on every core device), from ``reduce``'s last
    ``sums`` (None in a process with no core device)."""
    return None if sums is None else self._norm(sums)

  def update(self, pieces: dict | None, norm: jax.Array | None, state: dict | None
             ) -> dict | None:
    """The optimizer's update from the last round's ``reduce``, clipped by ``norm``
    (``state`` donated; no collective). Returns the new state (None in a process with no
    core device)."""
    return None if state is None else self._update(pieces, norm, state)

  def gather_params(self, state: dict | None, templates: list[dict | None]
                    ) -> list[dict | None]:
    """The updated parameters as each class's sync buffers (``name -> [replicas, degree,
    ..., L]``, in the buffers' dtypes; None for another process's class: for
    ``SplitStep.unpack``), gathered from the master weights' pieces.

    Args:
      state: the sharded state (None in a process with no core device: its classes'
        buffers keep only their positions past ``t_min``).
      templates: per class, the step's gradient buffers or their ``CrossClassSync.outer``,
        whose positions past ``t_min`` the result keeps.
    """
    first = next(t for t in templates if t is not None)
    lengths = tuple(sorted((name, x.shape[-1]) for name, x in first.items()))
    full = None if state is None else self._gather(state["master"], lengths=lengths,
                                                   cast=True)
    return self.sync.unstack(templates, full)

  def class_opt_states(self, state: dict | None, programs: Sequence[Any],
                       shapes: Sequence[Any], count: int,
                       dead: Collection[jax.Device] = frozenset()) -> list[Any]:
    """Each class's optimizer state in the class layout (``shapes``: its abstract state),
    the same as a replicated run keeps (None for another process's class): the moments,
    the step count and, where the state keeps them (``master_weights``), the float32
    master weights, each gathered in float32 from the pieces.

    Args:
      state: the sharded state (None in a process with no core device: it joins the
        classes' programs only).
      count: the optimizer's step count (host int, the same in every process).
      dead: devices whose pieces must not be read: each is taken from another copy, in
        this process or another (``_gather_live_fn``; every program here runs on them: a
        lost process's devices are the caller's to refuse, ``ShardedJobStep.class_programs``).

    Raises:
      LookupError: a piece is held by dead devices only (one line, for the log; the same
        in every process, from the plan's devices alone).
    """
    dead = set(dead) & set(self.mesh.devices.flat)  # past t_min: no piece to replace
    self._check_copies_reachable(dead)
    givers = self.live_givers(dead) if dead and state is not None else None
    opt = None if state is None else state["opt"]
    local = [holds_mine(p.mesh) for p in programs]

    def zeros(p):  # a float32 template in the class layout (donated to the unpacking)
      return p.step.zeros(p.params, dtype=MASTER_DTYPE)

    # Float32 buffers: only their shapes and positions past t_min (no data) are read.
    templates = [p.step.pack(zeros(p)) if here else None for p, here in zip(programs, local)]
    lengths = tuple(sorted((k, v.shape[-1]) for k, v in
                           next(t for t in templates if t is not None).items()))

    def unpacked(name):
      pieces = None if state is None else (
          state["master"] if name == MASTER else tree_utils.tree_get(opt, name))
      full = (None if pieces is None else self._gather(pieces, lengths=lengths)
              if givers is None else self._gather_live(pieces, givers, lengths=lengths))
      buffers = self.sync.unstack(templates, full)
      return [p.step.unpack(b, zeros(p)) if here else None
              for p, b, here in zip(programs, buffers, local)]

    masters = self._with_master(shapes)
    master = unpacked(MASTER) if masters else [None] * len(programs)
    moments = {field: unpacked(field) for field in self.fields}
    out = []
    for i, (program, here, shape, weights) in enumerate(zip(programs, local, shapes, master)):
      if not here:
        out.append(None)
        continue
      out.append(fill_class_state(shape, {f: m[i] for f, m in moments.items()}, weights,
                                  replicated_scalar(count, NamedSharding(program.mesh, P())),
                                  self.settings.name))
    return out

  @staticmethod
  def _with_master(shapes: Sequence[Any]) -> bool:
    """Whether the class layout's optimizer state keeps float32 master weights
    (``master_weights.MasterWeightsState``), the same for every class."""
    return any(tree_utils.tree_get(s, MASTER) is not None for s in shapes)

  def _check_copies_reachable(self, dead: set) -> None:
    """Raises ``LookupError`` where ``class_opt_states`` cannot give the state back: a piece
    held by dead devices only."""
    grid = self.mesh.devices
    for (_, p, j), device in np.ndenumerate(grid):
      if device in dead and all(grid[c, p, j] in dead for c in range(grid.shape[0])):
        raise LookupError(
            f"optimizer state piece {p} of peer group {j} was held by failed devices only "
            f"(train.optimizer_copies={self.settings.copies})")

  def lower_programs(self, class_blocks: Sequence[dict[str, Any]], rounds: int = 1
                     ) -> list[tuple[str, jax.stages.Lowered]]:
    """Every program of this object a plan runs, lowered for abstract arguments: cutting
    a class layout's state into pieces and starting from them (``start``), the step's
    (``lower_step``), and the gathering that gives the state back (``class_opt_states``).
    ``(what, lowered)`` each; ``class_blocks`` and ``rounds`` as for ``lower_step``."""
    # ``start`` cuts float32 trees (master weights, moments) laid out as the gradients.
    buffers = self._abstract_buffers(class_blocks[0], MASTER_DTYPE)
    state = self.abstract_state(class_blocks)
    pieces = state["master"]
    count = step_count(state["opt"])
    return [("sharded optimizer (into pieces)", self._scatter.lower(buffers)),
            ("sharded optimizer (start)",
             self._start.lower(pieces, (pieces,) * len(self.fields), count)),
            *self.lower_step(class_blocks, rounds),
            ("sharded optimizer (gather)", self.lower_gather(class_blocks))]

  def lower_step(self, class_blocks: Sequence[dict[str, Any]], rounds: int = 1
                 ) -> list[tuple[str, jax.stages.Lowered]]:
    """The programs of one step after the classes' gradient halves, lowered for abstract
    arguments, in the order they run: the reductions (``reduce``: zero1 one; zero2 the
    first micro-batch's, a middle one's and the last one's, as ``rounds`` asks; where
    ``reduce_in_two``, the reduce-scatter every round runs, then those of its sum over the
    copies), the norm, the update and the gathering of the parameters (``step_runs``: how
    often each runs). ``(what, lowered)`` each; compiling them ahead
    makes the first step compile nothing, and their memory analyses are one core
    device's.

    Args:
      class_blocks: each class's sync buffers (``steps.abstract_sync_blocks``:
        ``name -> [replicas, degree, ..., L]``); only their dtypes and ``L`` are read.
      rounds: zero2: the micro-batch rounds of a step (the classes' most micro-batches).

    Raises:
      ValueError: no class's buffers given.
    """
    state = self.abstract_state(class_blocks)
    buffers = self._abstract_buffers(class_blocks[0])
    total = state["master"]  # the summed pieces have the master weights' shapes
    rounds = rounds if self.settings.stage == 2 else 1
    split, what, out = self.reduce_in_two, "reduce", []
    if split:  # the reduce-scatter every round runs, then the sums over the copies
      what, into = "sum over the copies", jax.eval_shape(self._scatter_round, buffers)
      out.append(("sharded optimizer (reduce over each copy)",
                  self._scatter_round.lower(buffers)))
      buffers = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                            sharding=self.sharding), into)
    kinds = ([("", None, True)] if rounds == 1 else [("first micro-batch", None, False)]
             + [("next micro-batch", total, False)] * (rounds > 2)
             + [("last micro-batch", total, True)])
    lengths = _lengths(class_blocks[0])
    out += [(f"sharded optimizer ({what}{', ' + kind if kind else ''})",
             self._reduce.lower(buffers, t, lengths=lengths, last=last, scattered=split))
            for kind, t, last in kinds]
    # One value per core device: each device's sums going in.
    one = jax.ShapeDtypeStruct(self.sync.mesh.devices.shape, jnp.float32,
                               sharding=self.sharding)
    return out + [("sharded optimizer (norm)", self._norm.lower({"loss": one, "squares": one})),
                  (UPDATE_PROGRAM, self._update.lower(total, one, state)),
                  ("sharded optimizer (parameters gathered)",
                   self._gather.lower(total, lengths=lengths, cast=True))]

  def step_runs(self, rounds: int = 1) -> list[int]:
    """How often a step runs each program ``lower_step(..., rounds)`` gives, in its order."""
    rounds = rounds if self.settings.stage == 2 else 1
    reductions = [1] if rounds == 1 else [1, rounds - 2, 1] if rounds > 2 else [1, 1]
    if self.reduce_in_two:
      reductions = [rounds, *reductions]  # one reduce-scatter a round, then its sum
    return reductions + [1, 1, 1]

  def lower_gather(self, class_blocks: Sequence[dict[str, Any]]) -> jax.stages.Lowered:
    """The gathering of a moment's pieces into whole buffers (``class_opt_states``),
    lowered; ``class_blocks`` as for ``lower_step``."""
    lengths = tuple(sorted((name, x.shape[-1]) for name, x in class_blocks[0].items()))
    return self._gather.lower(self.abstract_state(class_blocks)["master"], lengths=lengths)

  def lower_gather_live(self, class_blocks: Sequence[dict[str, Any]]
                        ) -> jax.stages.Lowered | None:
    """The gathering from live copies after a failure (``_gather_live_fn``), lowered; None
    with one copy of each piece (a failed holder's piece then has no live copy)."""
    if self.mesh.devices.shape[0] == 1:
      return None
    lengths = tuple(sorted((name, x.shape[-1]) for name, x in class_blocks[0].items()))
    copies, pieces, t_min = self.mesh.devices.shape
    givers = jax.ShapeDtypeStruct((copies * pieces, t_min), np.int32, sharding=self.sharding)
    return self._gather_live.lower(self.abstract_state(class_blocks)["master"], givers,
                                   lengths=lengths)

  def abstract_state(self, class_blocks: Sequence[dict[str, Any]]) -> dict:
    """The state ``start`` makes, as ``jax.ShapeDtypeStruct``s over ``self.mesh`` (nothing
    allocated or traced but the optimizer's ``init``): each piece ``[live replicas, t_min,
    ceil(L / pieces)]`` in ``self.sharding`` and ``MASTER_DTYPE`` (``start`` casts every
    piece), the step counts replicated int32 scalars.

    Args:
      class_blocks: each class's sync buffers (``steps.abstract_sync_blocks``:
        ``name -> [replicas, degree, ..., L]``); only their dtypes and ``L`` are read.

    Raises:
      ValueError: no class's buffers given.
    """
    if not class_blocks:
      raise ValueError("abstract_state: no class's sync buffers given")
    replicas, t_min = self.sync.mesh.devices.shape
    pieces = {name: jax.ShapeDtypeStruct(
        (replicas, t_min, *x.shape[2:-1], -(-x.shape[-1] // self.pieces)), MASTER_DTYPE,
        sharding=self.sharding) for name, x in class_blocks[0].items()}
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(self.mesh, P()))
    state = jax.eval_shape(self._start_fn, pieces, (pieces,) * len(self.fields), count)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=self.sharding if x.ndim else NamedSharding(self.mesh, P())),
        state)

  def _abstract_buffers(self, blocks: dict[str, Any], dtype: Any = None
                        ) -> dict[str, jax.ShapeDtypeStruct]:
    """One class's buffers -> the stacked ``[live replicas, t_min, L]`` ones ``step`` takes
    (in ``dtype``, default each buffer's)."""
    replicas, t_min = self.sync.mesh.devices.shape
    return {name: jax.ShapeDtypeStruct((replicas, t_min, *x.shape[2:]), dtype or x.dtype,
                                       sharding=self.sharding) for name, x in blocks.items()}


def fill_class_state(shape: Any, moments: dict[str, Any], master: Any, count: jax.Array,
                     name: str) -> Any:
  """A class layout's optimizer state from its abstract one (``shape``): each field of
  ``moments`` (unpacked float32 trees, cast to the field's dtype), every ``count`` set to
  ``count``, and the master weights where given.

  Raises:
    ValueError: a leaf of the state is left unset (the state holds more than the sharded
      optimizer keeps); ``name`` is ``train.optimizer_sharding``'s value, for the line.
  """
  filled = _with_count(shape, count, **{
      field: jax.tree.map(as_dtype, tree, tree_utils.tree_get(shape, field))
      for field, tree in moments.items()})
  if master is not None:  # apart: with it, tree_set sets no field beside the master's
    filled = tree_utils.tree_set(filled, **{MASTER: master})
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(filled)):
    raise ValueError(f"train.optimizer_sharding={name}: the optimizer state holds more than "
                     f"a step count and the fields {sorted(moments)}")
  return filled


def cached_sharded_optimizer(cache, sync_key, sync: CrossClassSync, settings: ZeroSettings,
                             runs: DecayRuns, *, record: bool = True
                             ) -> tuple[Any, ShardedOptimizer]:
  """``(key, optimizer)``: the ``ShardedOptimizer`` over ``sync``'s devices from ``cache``."""
  key = ("zero", sync_key, settings, runs)
  return key, cache.get(key, "sharded optimizer",
                        functools.partial(ShardedOptimizer, sync, settings, runs), record=record)
