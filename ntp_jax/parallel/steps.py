"""The compiled step of one replica class: fused (one class) or split (several).

A class step is built once, from the class's state (shapes and shardings)
and ``StepSettings``; every function it holds is wrapped in ``jax.jit`` at
construction, which compiles nothing until the first call (or ``lower``).

- ``FusedStep``: the job has one class. Gradients, the DP all-reduce (a
  ``psum`` over ``'dp'`` inside the class program) and the optimizer update
  run in one program.
- ``SplitStep``: the job has several classes. The gradient half leaves the
  gradients in flat sync buffers (``sync.to_sync_blocks``); after
  ``sync.CrossClassSync`` the update half takes them back to the class
  layout and applies the update.

Both satisfy ``ClassStep``: ``apply`` (one step, what ``gradients`` left
for it), ``gradients`` (the work a failure inside a step throws away),
``eval_loss`` and ``lower`` (every program of the step, for cost and memory
analysis).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.layers.params import sum_shared_grads
from ntp_jax.layers.shard import replica_specs, restack_local, spec_shardings, unstack_local
from ntp_jax.parallel.accumulate import accumulate
from ntp_jax.parallel.grad_norm import clip_by_logical_norm, logical_norm
from ntp_jax.parallel.master_weights import needs_master
from ntp_jax.parallel.regroup import Regroup
from ntp_jax.parallel.sync import (
  from_sync_blocks,
  pack_buffers,
  synced_loss,
  to_sync_blocks,
  unpack_buffers,
)
from ntp_jax.parallel.sync_leaf import INT32_MAX, int32_overrun, sync_leaves
from ntp_jax.sharding.collectives import sum_if_many
from ntp_jax.sharding.mesh import DP, TP


def default_loss(model: nnx.Module, tokens: jax.Array, targets: jax.Array) -> jax.Array:
  """``model.loss_sum(tokens, targets)``: f32 sum of per-token losses over the local rows."""
  return model.loss_sum(tokens, targets)


@dataclasses.dataclass(frozen=True)
class StepSettings:
  """What a class step needs besides the class's state; ``key`` names it in a cache.

  Attributes:
    optimizer: the optax transformation.
    clip_norm: clip the logical gradient norm to this (``train.clip_norm``).
    global_tokens: predicted tokens in the whole step, over every class.
    loss: ``(module, tokens, targets) -> f32`` sum over a device's rows.
    optimizer_key: a hashable description of the optimizer's settings; two
      steps whose settings have equal keys share compiled programs. Default:
      the optimizer object itself (equal only to itself; the key holds it,
      so it is never mistaken for a later optimizer).

  Raises:
    TypeError: the key is not hashable (pass an ``optimizer_key``).
  """

  optimizer: optax.GradientTransformation
  clip_norm: float
  global_tokens: int
  loss: Callable[..., Any] = default_loss
  optimizer_key: Hashable | None = None

  def __post_init__(self):
    try:
      hash(self.key)
    except TypeError as err:
      raise TypeError(f"step settings: the optimizer cannot key a program cache ({err}); "
                      "pass optimizer_key, a hashable description of its settings") from None

  @property
  def key(self) -> tuple:
    optimizer = self.optimizer if self.optimizer_key is None else self.optimizer_key
    return (optimizer, self.clip_norm, self.global_tokens, self.loss)


class ClassStep(Protocol):
  """The compiled work of one replica class in a training step.

  ``params`` and ``opt_state`` are the class's replica-stacked state
  (``programs.class_shardings``); ``batch`` is int32
  ``[class rows, seq_len + 1]`` in ``P('dp')``.
  """

  def apply(self, params: Any, opt_state: Any, inputs: Any) -> tuple[Any, Any, dict]:
    """One optimizer step: ``(params, opt_state, {"loss", "grad_norm"})``, state donated.

    ``inputs``: the batch (``FusedStep``) or the synced gradient buffers
    (``SplitStep``, after ``sync.CrossClassSync``).
    """

  def gradients(self, params: Any, batch: jax.Array) -> Any:
    """The gradient half alone (nothing applied): ``FusedStep``: ``(loss, grads)``
    all-reduced over the class; ``SplitStep``: the sync buffers."""

  def eval_loss(self, params: Any, rows: jax.Array) -> jax.Array:
    """f32: the summed loss of ``rows`` (int32 ``[n, seq_len + 1]``, replicated)."""

  def lower(self, params: Any, opt_state: Any, batch: Any) -> list[jax.stages.Lowered]:
    """Every program of one step, lowered for these (maybe abstract) arguments."""


def _local_grads(graphdef, params_local, batch, global_tokens, loss, microbatches=1,
                 scan_microbatches=True):
  """Inside the body: this replica's loss share and gradients on its local blocks, its rows
  run as ``microbatches`` micro-batches (``parallel.accumulate``)."""
  params = unstack_local(params_local)

  def loss_of(p, rows):
    # rows: int32 [sequences, seq + 1]
    return loss(nnx.merge(graphdef, p), rows[:, :-1], rows[:, 1:]) / global_tokens

  loss, grads = accumulate(jax.value_and_grad(loss_of), params, batch, microbatches,
                           scan=scan_microbatches)
  return loss, sum_shared_grads(grads)


def _update(optimizer, clip_norm, replicas):
  apply = _apply_clipped(optimizer, clip_norm)

  def update(params, opt_state, grads):
    norm = logical_norm(grads, replicas, stacked=True)
    params, opt_state = apply(params, opt_state, grads, norm)
    return params, opt_state, norm
  return update


def _apply_clipped(optimizer, clip_norm):
  """``(params, opt_state, grads, norm) -> (params, opt_state)``: the update from gradients
  whose logical norm is known; elementwise for an elementwise optimizer (no collective)."""
  def apply(params, opt_state, grads, norm):
    grads = clip_by_logical_norm(grads, norm, clip_norm)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return apply


def _shardings_of(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.sharding, tree)


def make_loss_and_grad(graphdef: nnx.GraphDef, params: nnx.State, mesh: Mesh,
                       global_tokens: int, loss: Callable[..., Any] = default_loss,
                       microbatches: int = 1, scan_microbatches: bool = True
                       ) -> Callable[..., Any]:
  """``f(params, batch) -> (loss, grads)`` for one class, all-reduced over its replicas.

  Args:
    graphdef, params: the model and its replica-stacked parameters (for the specs).
    mesh: the class mesh.
    global_tokens: predicted tokens in the whole step, over every class.
    loss: ``(module, tokens, targets) -> f32`` sum over the local rows
      (``ntp_jax.model.ModelSpec.loss``; default ``module.loss_sum``).
    microbatches: micro-batches each replica's rows run as, their gradients
      summed (``parallel.accumulate``); scan_microbatches: under ``lax.scan``
      (False: unrolled, for cost analysis).

  The function takes ``batch: int32 [class sequences, seq_len + 1]`` and
  returns the class's share of the mean loss (f32 scalar) and its gradient,
  replica-stacked like ``params``. Not jitted.
  """
  specs = replica_specs(params)
  replicas = mesh.shape[DP]

  def body(params_local, batch):
    value, grads = _local_grads(graphdef, params_local, batch, global_tokens, loss,
                                microbatches, scan_microbatches)
    # DP all-reduce inside the class (every replica holds the same layout); none for one.
    grads = restack_local(sum_if_many(grads, DP, replicas))
    return sum_if_many(value, DP, replicas)[None], grads

  # Summed over replicas, the loss is the same on each; a lone replica's is returned as is
  # (its own axis, as it varies over 'dp' when no all-reduce ran).
  loss_spec = P() if replicas > 1 else P(DP)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DP)), out_specs=(loss_spec, specs))

  def loss_and_grad(params, batch):
    value, grads = fn(params, batch)
    return value[0], grads

  return loss_and_grad


def make_eval_loss(graphdef: nnx.GraphDef, params: nnx.State, mesh: Mesh,
                   loss: Callable[..., Any] = default_loss) -> Callable[..., Any]:
  """``f(params, rows) -> f32``: the summed loss of ``rows``, computed by every replica.

  ``rows`` is int32 ``[n, seq_len + 1]``, replicated over the class mesh. Not jitted.
  """
  specs = replica_specs(params)
  replicas = mesh.shape[DP]

  def body(params_local, rows):
    model = nnx.merge(graphdef, unstack_local(params_local))
    value = loss(model, rows[:, :-1], rows[:, 1:])
    # Every replica computed the same value: the mean makes that visible to shard_map.
    return (jax.lax.pmean(value, DP) if replicas > 1 else value)[None]

  fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P()),
                     out_specs=P() if replicas > 1 else P(DP))
  return lambda params, rows: fn(params, rows)[0]


@dataclasses.dataclass(frozen=True)
class FusedStep:
  """One class: gradients, DP all-reduce and update in one program (a ``ClassStep``).

  Attributes:
    step: jitted ``(params, opt_state, batch) -> (params, opt_state, metrics)``,
      state donated; ``metrics`` holds ``loss`` and ``grad_norm`` (f32 scalars).
    grads: jitted ``make_loss_and_grad``: ``(params, batch) -> (loss, grads)``.
    evaluate: jitted ``make_eval_loss``.
  """

  step: Callable[..., Any]
  grads: Callable[..., Any]
  evaluate: Callable[..., Any]

  @classmethod
  def build(cls, graphdef: nnx.GraphDef, params: Any, opt_state: Any, mesh: Mesh,
            settings: StepSettings, *, microbatches: int = 1,
            scan_microbatches: bool = True) -> FusedStep:
    """The step of a class over ``mesh`` whose state is ``params`` and ``opt_state``
    (arrays or ``ShapeDtypeStruct``s carrying the class shardings); each replica's rows
    run as ``microbatches`` micro-batches (``make_loss_and_grad``)."""
    specs = replica_specs(params)
    grads_fn = make_loss_and_grad(graphdef, params, mesh, settings.global_tokens, settings.loss,
                                  microbatches, scan_microbatches)
    update = _update(settings.optimizer, settings.clip_norm, mesh.devices.shape[0])

    def step(params, opt_state, batch):
      loss, grads = grads_fn(params, batch)
      params, opt_state, norm = update(params, opt_state, grads)
      return params, opt_state, {"loss": loss, "grad_norm": norm}

    shardings = spec_shardings(specs, mesh)
    opt_shardings = _shardings_of(opt_state)
    return cls(
        step=jax.jit(step, donate_argnums=(0, 1),
                     in_shardings=(shardings, opt_shardings, NamedSharding(mesh, P(DP))),
                     out_shardings=(shardings, opt_shardings, None)),
        grads=jax.jit(grads_fn),
        evaluate=jax.jit(make_eval_loss(graphdef, params, mesh, settings.loss)))

  def apply(self, params, opt_state, inputs):
    return self.step(params, opt_state, inputs)

  def gradients(self, params, batch):
    return self.grads(params, batch)

  def eval_loss(self, params, rows):
    return self.evaluate(params, rows)

  def lower(self, params, opt_state, batch) -> list[jax.stages.Lowered]:
    return [self.step.lower(params, opt_state, batch)]


@dataclasses.dataclass(frozen=True)
class SplitStep:
  """A class among several: the gradient half and the update half (a ``ClassStep``).

  Attributes:
    grad: jitted ``(params, batch) -> buffers``: ``name -> [replicas, degree, L]``, or
      ``[replicas, degree, layers, L]`` for stacked layers (``P('dp', 'tp')``), every
      parameter's sync block packed into one buffer per ``SyncLeaf.buffer``, the
      replica's loss share last in the ``float32`` one.
    micro_grad: jitted ``(params, batch, start, *, size) -> buffers``: as ``grad`` for
      one micro-batch, rows ``start : start + size`` of each replica's share
      (``start`` an int32 scalar, the same for every replica; ``size`` static), for
      ``train.optimizer_sharding=zero2`` (``accumulate.micro_starts`` gives each one's rows).
    update: jitted ``(params, opt_state, buffers) -> (params, opt_state, metrics)``
      after ``sync.CrossClassSync``, state donated; ``metrics`` holds the
      job's ``loss`` and ``grad_norm``, replicated over the class mesh.
    evaluate: jitted ``make_eval_loss``.
    mesh: the class mesh (for the abstract buffers in ``lower``).
    pack: jitted ``tree -> buffers``: any tree laid out as the parameters (the
      parameters, an Adam moment) in the sync buffers' layout, its loss slot 0
      (``zero.ShardedOptimizer`` keeps its state so).
    unpack: jitted ``(buffers, params) -> tree``: the inverse, ``params`` giving the
      layout (read for shapes only, and donated: the result takes its buffers).
    zeros: jitted ``(tree, *, dtype=None) -> tree`` of zeros in the class shardings, in
      ``dtype`` (default the tree's): a template for ``unpack`` that may be donated.
    leaves: the class's ``sync_leaf.sync_leaves``, in the order the buffers hold them.
    unpack_over: ``mesh -> program``: ``unpack`` over another ``('dp', 'tp')`` mesh of
      this class's layout (some of its rows: the replicas left after a lost process,
      ``zero_survivors``), nothing donated; one jitted program per mesh.
    finish: jitted ``(buffers, params) -> (grads, metrics)``: the update half's collectives
      alone, for steps that commit (``processes.commit``): the synced buffers
      back in the class layout, and the job's ``loss`` and ``grad_norm`` as each replica
      reads them (f32 ``[replicas]``, ``P('dp')``, all equal), with no collective across
      replicas; ``params`` gives the layout and is not donated.
    apply_grads: jitted ``(params, opt_state, grads, grad_norm) -> (params, opt_state)``:
      the rest of the update half, state donated; it runs no collective for an elementwise
      optimizer (``TrainingRun._compile_before_arriving`` checks the compiled program).
  """

  grad: Callable[..., Any]
  micro_grad: Callable[..., Any]
  update: Callable[..., Any]
  evaluate: Callable[..., Any]
  mesh: Mesh
  pack: Callable[..., Any]
  unpack: Callable[..., Any]
  zeros: Callable[..., Any]
  leaves: tuple
  unpack_over: Callable[[Mesh], Callable[..., Any]]
  finish: Callable[..., Any]
  apply_grads: Callable[..., Any]

  @classmethod
  def build(cls, graphdef: nnx.GraphDef, params: Any, opt_state: Any, mesh: Mesh,
            settings: StepSettings, t_min: int,
            regroups: dict[str, Regroup] | None = None, *, microbatches: int = 1,
            scan_microbatches: bool = True) -> SplitStep:
    """As ``FusedStep.build``; ``t_min``: the job's smallest TP degree; ``regroups``:
    the sync positions of each split parameter, the same for every class
    (``sync.regroup_plan``; default near-equal runs).

    Raises:
      OverflowError: a parameter's sync packing or a buffer's row would index more than
        ``2**31 - 1`` elements on one device (``sync_leaf.int32_overrun``: one layer's,
        for stacked layers), found from shapes.
    """
    specs = replica_specs(params)
    degree = mesh.devices.shape[1]
    # Computed once, host side: every walker of both halves reads these descriptors.
    leaves = sync_leaves(jax.eval_shape(unstack_local, params), degree, t_min, regroups)
    overrun = int32_overrun(leaves, sharded=False)  # the sharded optimizer checks its rows
    if overrun is not None:  # before tracing: numpy would fail deep inside it
      raise OverflowError(f"the split step at TP degree {degree} would index {overrun[1]:,} "
                          f"elements of {overrun[0]} per device with int32 (at most "
                          f"{INT32_MAX:,})")

    def grad_body(params_local, batch, count=microbatches):
      loss, grads = _local_grads(graphdef, params_local, batch, settings.global_tokens,
                                 settings.loss, count, scan_microbatches)
      buffers = pack_buffers(to_sync_blocks(grads, leaves), loss, leaves)
      # Every slot's buffer is its own: stack them over 'dp' and 'tp'.
      return {k: v[None] for k, v in buffers.items()}

    block_specs = P(DP, TP)
    batch_sharding = NamedSharding(mesh, P(DP))
    grad_fn = jax.jit(jax.shard_map(grad_body, mesh=mesh, in_specs=(specs, P(DP)),
                                    out_specs=block_specs),
                      in_shardings=(spec_shardings(specs, mesh), batch_sharding))

    def micro_grad_fn(params, batch, start, size):
      def body(params_local, batch, start):
        return grad_body(params_local, jax.lax.dynamic_slice_in_dim(batch, start, size, axis=0),
                         count=1)

      return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DP), P()),
                           out_specs=block_specs)(params, batch, start)

    micro_grad = jax.jit(micro_grad_fn, static_argnames=("size",))

    def restore_body(buffers, params_local):
      template = unstack_local(params_local)
      local = unpack_buffers({k: v[0] for k, v in buffers.items()}, leaves)
      return restack_local(from_sync_blocks(local, template, leaves))

    restore = jax.shard_map(restore_body, mesh=mesh, in_specs=(block_specs, specs),
                            out_specs=specs)

    def pack_body(tree_local):
      blocks = to_sync_blocks(unstack_local(tree_local), leaves)
      return {k: v[None] for k, v in pack_buffers(blocks, jnp.zeros((), jnp.float32),
                                                   leaves).items()}

    pack = jax.shard_map(pack_body, mesh=mesh, in_specs=(specs,), out_specs=block_specs)
    update = _update(settings.optimizer, settings.clip_norm, mesh.devices.shape[0])

    def update_step(params, opt_state, buffers):
      grads = restore(buffers, params)
      params, opt_state, norm = update(params, opt_state, grads)
      return params, opt_state, {"loss": synced_loss(buffers), "grad_norm": norm}

    shardings = spec_shardings(specs, mesh)
    opt_shardings = _shardings_of(opt_state)
    replicated = NamedSharding(mesh, P())
    update_fn = jax.jit(update_step, donate_argnums=(0, 1),
                        out_shardings=(shardings, opt_shardings,
                                       {"loss": replicated, "grad_norm": replicated}))

    def finish(buffers, params):
      grads = restore(buffers, params)
      # Each replica's own: no collective across replicas (a peer lost in one would leave
      # another replica's collectives half-entered; job_step._committed_step).
      norm = logical_norm(grads, stacked=True, per_replica=True)
      return grads, {"loss": synced_loss(buffers, per_replica=True), "grad_norm": norm}

    by_replica = NamedSharding(mesh, P(DP))
    metric_shardings = {"loss": by_replica, "grad_norm": by_replica}
    finish_fn = jax.jit(finish, out_shardings=(shardings, metric_shardings))
    apply_grads = jax.jit(_apply_clipped(settings.optimizer, settings.clip_norm),
                          donate_argnums=(0, 1), in_shardings=(
                              shardings, opt_shardings, shardings, by_replica),
                          out_shardings=(shardings, opt_shardings))
    return cls(grad=grad_fn, micro_grad=micro_grad, update=update_fn,
               evaluate=jax.jit(make_eval_loss(graphdef, params, mesh, settings.loss)),
               mesh=mesh, pack=jax.jit(pack), unpack=jax.jit(restore, out_shardings=shardings,
                                                              donate_argnums=(1,)),
               zeros=jax.jit(lambda tree, dtype=None: jax.tree.map(
                   lambda x: jnp.zeros_like(x, dtype=dtype), tree), static_argnames=("dtype",),
                             out_shardings=shardings), leaves=leaves,
               unpack_over=functools.cache(lambda rows: jax.jit(jax.shard_map(
                   restore_body, mesh=rows, in_specs=(block_specs, specs), out_specs=specs))),
               finish=finish_fn, apply_grads=apply_grads)

  def apply(self, params, opt_state, inputs):
    return self.update(params, opt_state, inputs)

  def gradients(self, params, batch):
    return self.grad(params, batch)

  def eval_loss(self, params, rows):
    return self.evaluate(params, rows)

  def lower(self, params, opt_state, batch) -> list[jax.stages.Lowered]:
    blocks = abstract_sync_blocks(self.grad, params, batch, self.mesh)
    return [self.grad.lower(params, batch), self.update.lower(params, opt_state, blocks)]

  def lower_committed(self, params, opt_state, batch) -> list[jax.stages.Lowered]:
    """The programs of a step that commits (``finish`` and ``apply_grads`` in place of
    ``update``), lowered for these (maybe abstract) arguments."""
    blocks = abstract_sync_blocks(self.grad, params, batch, self.mesh)
    grads, metrics = jax.eval_shape(self.finish, blocks, params)
    grads = jax.tree.map(lambda g, p: jax.ShapeDtypeStruct(g.shape, g.dtype,
                                                           sharding=p.sharding), grads, params)
    norm = jax.ShapeDtypeStruct(metrics["grad_norm"].shape, jnp.float32,
                                sharding=NamedSharding(self.mesh, P(DP)))
    return [self.grad.lower(params, batch), self.finish.lower(blocks, params),
            self.apply_grads.lower(params, opt_state, grads, norm)]

  def lower_sharded(self, params, batch, micro_sizes: Sequence[int] = ()
                    ) -> list[jax.stages.Lowered]:
    """The programs this class runs with a sharded optimizer (``zero``): the gradient
    half (zero2: ``micro_grad`` for each of ``micro_sizes`` rows instead), packing a
    parameter-shaped tree, the zeroed template and unpacking into it, for the parameters
    and (where they are stored in less) for float32 trees (master weights and moments:
    ``zero.ShardedOptimizer.start``, ``class_opt_states``)."""
    blocks = abstract_sync_blocks(self.grad, params, batch, self.mesh)
    start = jax.ShapeDtypeStruct((), np.int32)
    grads = ([self.micro_grad.lower(params, batch, start, size=size) for size in micro_sizes]
             if micro_sizes else [self.grad.lower(params, batch)])
    out = grads + [self.pack.lower(params), self.zeros.lower(params),
                   self.unpack.lower(blocks, params)]
    if needs_master(params):
      out += [self.pack.lower(as_float32(params)), *self.lower_read_back(params)]
    return out

  def lower_read_back(self, params) -> list[jax.stages.Lowered]:
    """The programs ``zero.ShardedOptimizer.class_opt_states`` runs on this class that no
    step does: the float32 template and, where the parameters are stored in less than
    float32, the unpacking of float32 buffers into it (``params``: abstract, sharded)."""
    out = [self.zeros.lower(params, dtype=jnp.float32)]
    if needs_master(params):
      sharding = NamedSharding(self.mesh, P(DP, TP))
      blocks = {name: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=sharding)
                for name, x in jax.eval_shape(self.pack, params).items()}
      out.append(self.unpack.lower(blocks, as_float32(params)))
    return out


def as_float32(tree: Any) -> Any:
  """Abstract arrays (``jax.ShapeDtypeStruct``s) with their floating leaves in float32."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype,
      sharding=x.sharding), tree)


def abstract_sync_blocks(grad: Callable[..., Any], params: Any, batch: Any,
                         mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """The sync buffers ``grad(params, batch)`` returns, as sharded ``ShapeDtypeStruct``s.

  For lowering a class's update half without running its gradient half.
  """
  blocks = jax.eval_shape(grad, params, batch)
  sharding = NamedSharding(mesh, P(DP, TP))
  return {k: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=sharding) for k, b in blocks.items()}
