"""Programs of one replica class, and the job's step over all classes.

A class program runs over its own ``('dp', 'tp')`` sub-mesh and keeps one
copy of parameters and optimizer state per replica (``shard.replica_specs``).
With one class the DP all-reduce runs inside the class program (a plain
``psum`` over ``'dp'``), fused with the optimizer update. With several
classes a step is: each class computes its gradients and moves them to the
sync layout; ``sync.CrossClassSync`` all-reduces the peer groups; each class
moves them back and applies the update. Programs of different classes are
dispatched back to back and run concurrently on their own devices.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.layers.params import TPParam, sum_shared_grads
from ntp_jax.parallel.plan import Plan, ReplicaClass
from ntp_jax.parallel.regroup import Regroup
from ntp_jax.parallel.sync import (
  CrossClassSync,
  from_sync_blocks,
  pack_buffers,
  regroup_plan,
  sync_block_sizes,
  synced_loss,
  to_sync_blocks,
  unpack_buffers,
)
from ntp_jax.sharding.mesh import DP, TP, class_mesh
from ntp_jax.sharding.shard import (
  replica_specs,
  restack_local,
  spec_shardings,
  stack_replicas,
  unstack_local,
)
from ntp_jax.state.placement import LogicalSource, place_logical, read_logical
from ntp_jax.state.sources import InitSource
from ntp_jax.state.spanning import SpanningSource, read_logical_spanning
from ntp_jax.train.model_spec import default_loss
from ntp_jax.train.optim import clip_by_logical_norm, logical_norm


@dataclasses.dataclass
class ClassProgram:
  """State and compiled functions of one replica class."""

  replica_class: ReplicaClass
  mesh: Mesh
  graphdef: nnx.GraphDef
  params: nnx.State  # replica-stacked
  opt_state: Any
  step: Callable[..., Any] | None = None  # single class: fused grad + all-reduce + update
  grad: Callable[..., Any] | None = None  # several classes: (params, batch) -> (loss, sync blocks)
  update: Callable[..., Any] | None = None  # several classes: (params, opt, blocks) -> ...
  grads_only: Callable[..., Any] | None = None  # single class: (params, batch) -> (loss, grads)
  loss: Callable[..., Any] = default_loss  # (module, tokens, targets) -> f32 sum over local rows
  eval_loss: Callable[..., Any] | None = None  # (params, rows) -> per-row loss; made on first use

  @property
  def replicas(self) -> int:
    return len(self.replica_class.replicas)

  @property
  def batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(DP))


def abstract_params(make_model: Callable[[], nnx.Module]) -> nnx.State:
  """Shapes and dtypes of one copy of the parameters, allocating nothing."""
  return nnx.split(nnx.eval_shape(make_model))[1]


def abstract_class_state(make_model: Callable[[], nnx.Module], replicas: int,
                         optimizer: optax.GradientTransformation
                         ) -> tuple[nnx.GraphDef, dict[str, Any]]:
  """The graph and the abstract replica-stacked state ``{"params", "opt_state"}`` of a class."""
  graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
  params = jax.eval_shape(lambda s: stack_replicas(s, replicas), abstract)
  return graphdef, {"params": params, "opt_state": jax.eval_shape(optimizer.init, params)}


def init_stacked_params(make_model: Callable[[], nnx.Module], mesh: Mesh,
                        replicas: int) -> tuple[nnx.GraphDef, nnx.State]:
  """Parameters built directly in their sharded, replica-stacked layout on ``mesh``."""
  graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
  shardings = spec_shardings(replica_specs(abstract), mesh)
  params = jax.jit(lambda: stack_replicas(nnx.split(make_model())[1], replicas),
                   out_shardings=shardings)()
  return graphdef, params


def class_shardings(tree: Any, mesh: Mesh) -> Any:
  """Sharding of every leaf of a class state: ``P('dp', 'tp')`` for ``TPParam`` blocks,
  ``P('dp')`` for other variables (replica-stacked), ``P()`` for bare arrays (step counts).

  Initialisation, placement and the step all use these, so a state made any
  way meets the same compiled step.
  """
  def sharding(x):
    if isinstance(x, nnx.Variable):
      return x.replace(NamedSharding(mesh, P(DP, TP) if isinstance(x, TPParam) else P(DP)))
    return NamedSharding(mesh, P())
  return jax.tree.map(sharding, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def init_opt_state(optimizer: optax.GradientTransformation, params: nnx.State, mesh: Mesh):
  """Optimizer state on the class mesh, in ``class_shardings`` (moments follow their
  parameter, step counts replicated)."""
  abstract = jax.eval_shape(optimizer.init, params)
  return jax.jit(optimizer.init, out_shardings=class_shardings(abstract, mesh))(params)


def _local_grads(graphdef, params_local, batch, global_tokens, loss):
  """Inside the body: this replica's loss share and gradients on its local blocks."""
  params = unstack_local(params_local)

  def loss_of(p):
    # batch: int32 [local sequences, seq + 1]
    return loss(nnx.merge(graphdef, p), batch[:, :-1], batch[:, 1:]) / global_tokens

  loss, grads = jax.value_and_grad(loss_of)(params)
  return loss, sum_shared_grads(grads)


def _update(optimizer, clip_norm, replicas):
  def update(params, opt_state, grads):
    norm = logical_norm(grads, replicas, stacked=True)
    grads = clip_by_logical_norm(grads, norm, clip_norm)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, norm
  return update


def make_loss_and_grad(graphdef: nnx.GraphDef, params: nnx.State, mesh: Mesh,
                       global_tokens: int, loss: Callable[..., Any] = default_loss
                       ) -> Callable[..., Any]:
  """``f(params, batch) -> (loss, grads)`` for one class, all-reduced over its replicas.

  Args:
    graphdef, params: the model and its replica-stacked parameters (for the specs).
    mesh: the class mesh.
    global_tokens: predicted tokens in the whole step, over every class.
    loss: ``(module, tokens, targets) -> f32`` sum over the local rows
      (``model_spec.ModelSpec.loss``; default ``module.loss_sum``).

  The function takes ``batch: int32 [class sequences, seq_len + 1]`` and
  returns the class's share of the mean loss (f32 scalar) and its gradient,
  replica-stacked like ``params``.
  """
  specs = replica_specs(params)

  def body(params_local, batch):
    value, grads = _local_grads(graphdef, params_local, batch, global_tokens, loss)
    # DP all-reduce inside the class: every replica holds the same layout.
    return jax.lax.psum(value, DP), restack_local(jax.lax.psum(grads, DP))

  return jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DP)), out_specs=(P(), specs))


def make_eval_loss(program: ClassProgram) -> Callable[..., Any]:
  """``f(params, rows) -> f32``: the summed loss of ``rows``, computed by every replica.

  ``rows`` is int32 ``[n, seq_len + 1]``, replicated over the class mesh.
  """
  specs = replica_specs(program.params)
  graphdef, loss = program.graphdef, program.loss

  def body(params_local, rows):
    model = nnx.merge(graphdef, unstack_local(params_local))
    # Every replica computed the same value: the mean makes that visible to shard_map.
    return jax.lax.pmean(loss(model, rows[:, :-1], rows[:, 1:]), DP)

  return jax.shard_map(body, mesh=program.mesh, in_specs=(specs, P()), out_specs=P())


def make_fused_step(program: ClassProgram, optimizer: optax.GradientTransformation,
                    clip_norm: float, global_tokens: int):
  """Single-class step: ``(params, opt_state, batch) -> (params, opt_state, metrics)``."""
  specs = replica_specs(program.params)
  grads_fn = make_loss_and_grad(program.graphdef, program.params, program.mesh, global_tokens,
                                program.loss)
  update = _update(optimizer, clip_norm, program.replicas)

  def step(params, opt_state, batch):
    loss, grads = grads_fn(params, batch)
    params, opt_state, norm = update(params, opt_state, grads)
    return params, opt_state, {"loss": loss, "grad_norm": norm}

  shardings = spec_shardings(specs, program.mesh)
  opt_shardings = _shardings_of(program.opt_state)
  return jax.jit(step, donate_argnums=(0, 1),
                 in_shardings=(shardings, opt_shardings, program.batch_sharding),
                 out_shardings=(shardings, opt_shardings, None))


def make_split_step(program: ClassProgram, optimizer: optax.GradientTransformation,
                    clip_norm: float, global_tokens: int, t_min: int,
                    regroups: dict[str, Regroup] | None = None):
  """Several classes: the gradient half (to flat sync buffers) and the update half (from them).

  ``grad(params, batch) -> buffers``: ``dtype -> [replicas, degree, L]``
  (``P('dp', 'tp')``), every parameter's sync block packed into one flat
  buffer per dtype, the replica's loss share last in the ``float32`` one.
  ``update(params, opt_state, buffers) -> (params, opt_state, metrics)``
  after ``sync.CrossClassSync``; ``metrics`` holds the job's ``loss`` and
  ``grad_norm``, replicated over the class mesh. ``regroups``: the sync
  positions of each split parameter, the same for every class
  (``sync.regroup_plan``; default near-equal runs).
  """
  specs = replica_specs(program.params)
  degree = program.replica_class.degree
  graphdef = program.graphdef

  def grad_body(params_local, batch):
    loss, grads = _local_grads(graphdef, params_local, batch, global_tokens, program.loss)
    buffers = pack_buffers(to_sync_blocks(grads, degree, t_min, regroups), loss)
    # Every slot's buffer is its own: stack them over 'dp' and 'tp'.
    return {k: v[None] for k, v in buffers.items()}

  block_specs = P(DP, TP)

  grad_fn = jax.jit(jax.shard_map(grad_body, mesh=program.mesh, in_specs=(specs, P(DP)),
                                  out_specs=block_specs),
                    in_shardings=(spec_shardings(specs, program.mesh), program.batch_sharding))

  def restore_body(buffers, params_local):
    template = unstack_local(params_local)
    local = unpack_buffers({k: v[0] for k, v in buffers.items()},
                           sync_block_sizes(template, degree, t_min, regroups))
    return restack_local(from_sync_blocks(local, template, degree, t_min, regroups))

  restore = jax.shard_map(restore_body, mesh=program.mesh, in_specs=(block_specs, specs),
                          out_specs=specs)
  update = _update(optimizer, clip_norm, program.replicas)

  def update_step(params, opt_state, buffers):
    grads = restore(buffers, params)
    params, opt_state, norm = update(params, opt_state, grads)
    return params, opt_state, {"loss": synced_loss(buffers), "grad_norm": norm}

  shardings = spec_shardings(specs, program.mesh)
  opt_shardings = _shardings_of(program.opt_state)
  replicated = NamedSharding(program.mesh, P())
  update_fn = jax.jit(update_step, donate_argnums=(0, 1),
                      out_shardings=(shardings, opt_shardings,
                                     {"loss": replicated, "grad_norm": replicated}))
  return grad_fn, update_fn


def abstract_sync_blocks(grad: Callable[..., Any], params: Any, batch: Any,
                         mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
  """The sync buffers ``grad(params, batch)`` returns, as sharded ``ShapeDtypeStruct``s.

  For lowering a class's update half without running its gradient half.
  """
  blocks = jax.eval_shape(grad, params, batch)
  sharding = NamedSharding(mesh, P(DP, TP))
  return {k: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=sharding) for k, b in blocks.items()}


def _shardings_of(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.sharding, tree)


class ProgramCache:
  """Step functions of class programs by layout and devices, and cross-class syncs.

  A plan met again (a repaired replica back at its old layout, a second
  failure that gives a layout seen before) reuses the jitted functions, whose
  executables JAX keeps: it compiles nothing. ``events`` records each lookup
  as ``(description, hit)``.
  """

  def __init__(self):
    self._entries: dict[Any, Any] = {}
    self.events: list[tuple[str, bool]] = []

  def get(self, key: Any, what: str, make: Callable[[], Any]) -> Any:
    hit = key in self._entries
    if not hit:
      self._entries[key] = make()
    self.events.append((what, hit))
    return self._entries[key]

  @property
  def hits(self) -> int:
    return sum(hit for _, hit in self.events)

  @property
  def misses(self) -> int:
    return sum(not hit for _, hit in self.events)


def build_class_programs(plan: Plan, make_model: Callable[[Any], nnx.Module],
                         optimizer: optax.GradientTransformation, clip_norm: float,
                         global_tokens: int, devices: Sequence[jax.Device], *,
                         source: LogicalSource | None = None,
                         cache: ProgramCache | None = None,
                         loss: Callable[..., Any] = default_loss) -> list[ClassProgram]:
  """Place every class's parameters and optimizer state and compile its step.

  Args:
    make_model: ``layouts -> module``; the same seed must give the same
      logical parameters for every layout.
    source: logical state to start from (``ntp_jax.state.placement``): a
      checkpoint, a live replica, ...; default: fresh parameters of the
      degree-1 model (``InitSource``). Optimizer state the source does not
      hold starts from ``optimizer.init``.
    cache: reuse step functions compiled for an equal class before.
    loss: ``(module, tokens, targets) -> f32`` sum over a device's rows.

  Raises:
    ValueError: the source holds part of the optimizer state only.
  """
  if source is None:
    source = InitSource(lambda: make_model(plan.logical_layouts))
  meshes = [class_mesh(c.replicas, c.live_slots, plan.tp, devices) for c in plan.classes]
  targets = [abstract_class_state(lambda c=c: make_model(c.layouts), len(c.replicas), optimizer)
             for c in plan.classes]
  if jax.process_count() > 1:  # one collective read for every class (see ntp_jax.state.spanning)
    source = SpanningSource(source, targets[0][1], meshes, min(c.degree for c in plan.classes))
  programs = []
  for replica_class, mesh, (graphdef, target) in zip(plan.classes, meshes, targets):
    if not is_local(mesh):  # another process's class: its state stays abstract here
      programs.append(ClassProgram(replica_class, mesh, graphdef, target["params"],
                                   target["opt_state"], loss=loss))
      continue
    state, filled = place_logical(target, mesh, source)
    opt_paths = {p for p in filled if p[0] == "opt_state"}
    if not opt_paths:
      opt_state = init_opt_state(optimizer, state["params"], mesh)
    elif len(opt_paths) == len(jax.tree.leaves(target["opt_state"])):
      opt_state = state["opt_state"]
    else:
      raise ValueError(f"optimizer state: the source holds {len(opt_paths)} of "
                       f"{len(jax.tree.leaves(target['opt_state']))} leaves")
    programs.append(ClassProgram(replica_class, mesh, graphdef, state["params"], opt_state,
                                 loss=loss))
  attach_steps(plan, programs, optimizer, clip_norm, global_tokens, cache or ProgramCache())
  return programs


def attach_steps(plan: Plan, programs: list[ClassProgram],
                 optimizer: optax.GradientTransformation, clip_norm: float,
                 global_tokens: int, cache: ProgramCache) -> None:
  """Attach the step functions of every class (fused with one class, split with several)."""
  t_min = min(c.degree for c in plan.classes)
  regroups = None
  if len(programs) > 1:  # where each element is synced: chosen once, for every class
    regroups = regroup_plan([(jax.eval_shape(unstack_local, p.params), p.replicas)
                             for p in programs], t_min)
  for program in programs:
    if not is_local(program.mesh):
      continue  # another process's class: never called here
    c = program.replica_class
    fused = len(programs) == 1
    key = (program.mesh, c.layouts, fused, t_min, global_tokens, id(optimizer), clip_norm,
           program.loss)
    what = f"class program (TP degree {c.degree}, replicas {list(c.replicas)})"
    if fused:
      program.step = cache.get(key, what, lambda p=program: make_fused_step(
          p, optimizer, clip_norm, global_tokens))
    else:
      key += (tuple(sorted(regroups.items())),)
      program.grad, program.update = cache.get(key, what, lambda p=program: make_split_step(
          p, optimizer, clip_norm, global_tokens, t_min, regroups))


def logical_state(programs: list[ClassProgram]) -> dict:
  """The job's state in logical form (``placement.read_logical`` of the first class).

  Every replica holds identical state, so one replica's copy is the job's. In
  a multi-process job the arrays span every replica (``spanning``), each
  process holding its own devices' pieces, as orbax's collective save wants.
  """
  if jax.process_count() > 1:
    t_min = min(p.replica_class.degree for p in programs)
    return read_logical_spanning(
        [({"params": p.params, "opt_state": p.opt_state}, p.mesh) for p in programs], t_min)
  program = programs[0]
  return read_logical({"params": program.params, "opt_state": program.opt_state}, program.mesh)


def is_local(mesh: Mesh) -> bool:
  """``mesh`` holds a device of this process (its programs must be called here)."""
  return any(d.process_index == jax.process_index() for d in mesh.devices.flat)


def class_batch(program: ClassProgram, batch: Any, start: int) -> jax.Array:
  """The class's rows ``batch[start:start + class rows]`` as a ``P('dp')`` array.

  ``batch`` is anything sliceable by rows with a ``shape`` (a numpy array,
  ``loop.DatasetRows``): only the rows of the replicas whose devices this
  process drives are read, once per replica.
  """
  rows = program.replica_class.batch_rows
  read: dict[tuple[int, int], np.ndarray] = {}

  def rows_of(index):
    lo, hi = index[0].start or 0, rows if index[0].stop is None else index[0].stop
    if (lo, hi) not in read:
      read[(lo, hi)] = np.asarray(batch[start + lo:start + hi], np.int32)
    return read[(lo, hi)]

  return jax.make_array_from_callback((rows, batch.shape[1]), program.batch_sharding, rows_of)


def covering_classes(programs: list[ClassProgram]) -> list[int]:
  """Classes that, between them, hold a device of every process (first classes first).

  Work that one copy of the state suffices for (evaluation) runs on these:
  every process takes part in a program of each one it holds a device of.
  """
  chosen, covered = [], set()
  for i, program in enumerate(programs):
    processes = {d.process_index for d in program.mesh.devices.flat}
    if not processes <= covered:
      chosen.append(i)
      covered |= processes
  return chosen


@functools.lru_cache(maxsize=16)
def _read_loss(mesh: Mesh) -> Callable[..., Any]:
  return jax.jit(synced_loss, out_shardings=NamedSharding(mesh, P()))


class JobStep:
  """One training step of the whole job over its class programs.

  In a multi-process job each process calls the programs of the classes
  that hold its devices (``local``), reads only those classes' batch rows,
  and joins the cross-class all-reduce when it holds a core slot; the loss
  comes back from the all-reduce, so no process reads another's devices.
  """

  def __init__(self, plan: Plan, programs: list[ClassProgram],
               cache: ProgramCache | None = None):
    self.plan = plan
    self.programs = programs
    self.local = [is_local(p.mesh) for p in programs]
    if not any(self.local):
      raise ValueError(f"process {jax.process_index()} holds no live device of the plan "
                       f"(TP degrees {[r.degree for r in plan.replicas]})")
    self.sync = None
    if len(programs) > 1:
      meshes, t_min = [p.mesh for p in programs], min(c.degree for c in plan.classes)
      self.sync = (cache or ProgramCache()).get(
          ("sync", tuple(meshes), t_min), "cross-class sync",
          lambda: CrossClassSync(meshes, t_min))

  @property
  def first_local(self) -> ClassProgram:
    return self.programs[self.local.index(True)]

  def gradients_only(self, batch: Any) -> float:
    """Loss and gradients of ``batch`` (synced across classes), not applied.

    The work that a failure inside a step throws away; the state is unchanged.
    """
    if self.sync is None:
      program = self.programs[0]
      if program.grads_only is None:
        program.grads_only = jax.jit(make_loss_and_grad(
            program.graphdef, program.params, program.mesh,
            self.plan.global_batch * (batch.shape[1] - 1), program.loss))
      loss, grads = program.grads_only(program.params, class_batch(program, batch, 0))
      jax.block_until_ready(grads)
      return float(loss)
    synced = self._synced_buffers(batch)
    jax.block_until_ready(synced)
    i = self.local.index(True)
    return float(_read_loss(self.programs[i].mesh)(synced[i]))

  def eval_loss(self, sequences: np.ndarray) -> float:
    """Mean next-token loss of ``sequences`` (int32 ``[n, seq_len + 1]``), no update.

    Every replica holds the same parameters, so one class evaluates (one per
    process group in a multi-process job, ``covering_classes``): each of its
    replicas computes every row, in chunks of the class's training batch
    share (so activations fit as in a step; a shorter last chunk compiles
    once more).
    """
    value = None
    for i in covering_classes(self.programs):
      if not self.local[i]:
        continue
      program = self.programs[i]
      rows = program.replica_class.batch_share
      if program.eval_loss is None:
        program.eval_loss = jax.jit(make_eval_loss(program))
      replicated = NamedSharding(program.mesh, P())
      total = 0.0
      for start in range(0, len(sequences), rows):
        chunk = np.asarray(sequences[start:start + rows], np.int32)
        total += float(program.eval_loss(program.params, jax.make_array_from_callback(
            chunk.shape, replicated, lambda index, c=chunk: c[index])))
      value = total / (len(sequences) * (sequences.shape[1] - 1)) if value is None else value
    return value

  def _synced_buffers(self, batch: Any) -> list[dict | None]:
    """Several classes: each local class's synced gradient buffers (None elsewhere)."""
    buffers: list[dict | None] = []
    for program, local, (start, _) in zip(self.programs, self.local, self.plan.class_rows()):
      buffers.append(program.grad(program.params, class_batch(program, batch, start))
                     if local else None)
    return self.sync(buffers)

  def __call__(self, batch: Any) -> dict[str, jax.Array]:
    """``batch``: int32 ``[plan.global_batch, seq + 1]`` rows in class order (or a lazy
    ``loop.DatasetRows``); returns the job's ``loss`` and ``grad_norm``, replicated over a
    class mesh this process holds."""
    if self.sync is None:
      program = self.programs[0]
      program.params, program.opt_state, metrics = program.step(
          program.params, program.opt_state, class_batch(program, batch, 0))
      return metrics
    metrics = None
    for program, local, buffers in zip(self.programs, self.local, self._synced_buffers(batch)):
      if local:
        program.params, program.opt_state, class_metrics = program.update(
            program.params, program.opt_state, buffers)
        metrics = metrics or class_metrics
    return metrics
