"""Programs of the replica classes: each class's state, placed on its sub-mesh, and its step.

A class program runs over its own ``('dp', 'tp')`` sub-mesh and keeps one
copy of parameters and optimizer state per replica (``shard.replica_specs``).
Its step (``steps.FusedStep`` with one class, ``steps.SplitStep`` with
several) is taken from a ``ProgramCache``, so a plan met again compiles
nothing. ``PlanPrograms`` makes every program of a plan once, for building it
and for compiling it ahead. ``job_step.JobStep`` runs one step of every class.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.layers.params import TPParam
from ntp_jax.layers.shard import replica_specs, spec_shardings, stack_replicas, unstack_local
from ntp_jax.parallel import metrics_handoff
from ntp_jax.parallel.accumulate import micro_batches
from ntp_jax.parallel.plan import Plan, ReplicaClass
from ntp_jax.parallel.steps import (
  ClassStep,
  FusedStep,
  SplitStep,
  StepSettings,
  abstract_sync_blocks,
  default_loss,
)
from ntp_jax.parallel.sync import CrossClassSync, plan_regroups
from ntp_jax.parallel.zero import UPDATE_PROGRAM, ZeroSettings, cached_sharded_optimizer, runs_of
from ntp_jax.program_cache import ProgramCache
from ntp_jax.sharding.mesh import DP, TP, class_mesh
from ntp_jax.sharding.topology import holds_mine, is_mine, processes_of
from ntp_jax.state.placement import LogicalSource, Placement, read_logical
from ntp_jax.state.sources import InitSource
from ntp_jax.state.spanning import SpanningSource, read_logical_spanning

# Names the update of a step that commits in ``PlanPrograms.lower``'s list.
UPDATE_SUFFIX = ", update after the vote"


@dataclasses.dataclass
class ClassProgram:
  """State and compiled step of one replica class.

  Attributes:
    replica_class: the plan's class. mesh: its ``('dp', 'tp')`` sub-mesh.
    graphdef: the model's graph at the class's layouts.
    params, opt_state: replica-stacked state in ``class_shardings`` (abstract
      for a class of another process).
    step: the class's ``steps.ClassStep``; None where no step runs on this
      copy (a class with no device in this process; ``footprint``'s
      abstract programs, which build the step they lower).
  """

  replica_class: ReplicaClass
  mesh: Mesh
  graphdef: nnx.GraphDef
  params: nnx.State  # replica-stacked
  opt_state: Any
  step: ClassStep | None = None
  key: Hashable | None = None  # the step's ``ProgramCache`` key

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


@dataclasses.dataclass(frozen=True)
class PlanShapes:
  """A plan's class meshes and abstract state: what its programs are made from.

  Attributes:
    plan: the plan. meshes: each class's ``('dp', 'tp')`` mesh.
    targets: each class's ``(graphdef, {"params", "opt_state"})``, abstract
      (``abstract_class_state``).
    t_min: the smallest TP degree. regroups: the sync positions of each
      split parameter with several classes (``sync.regroup_plan``), else None.
  """

  plan: Plan
  meshes: list[Mesh]
  targets: list[tuple[nnx.GraphDef, dict[str, Any]]]
  t_min: int
  regroups: dict | None


def plan_shapes(plan: Plan, make_model: Callable[[Any], nnx.Module],
                optimizer: optax.GradientTransformation, devices: Sequence[jax.Device],
                cache: ProgramCache | None = None, settings: StepSettings | None = None
                ) -> PlanShapes:
  """Meshes and abstract state of every class of ``plan`` (nothing allocated).

  With a ``cache`` (and the step ``settings``, which name the optimizer), a
  class's abstract state is worked out once: a plan compiled ahead costs no
  shape inference when it is met.
  """
  meshes = [class_mesh(c.replicas, c.live_slots, plan.tp, devices) for c in plan.classes]

  def target(c):
    make = functools.partial(abstract_class_state, lambda: make_model(c.layouts),
                             len(c.replicas), optimizer)
    if cache is None or settings is None:
      return make()
    return cache.get(("state shapes", c.layouts, len(c.replicas), settings.key), "", make,
                     record=False)

  targets = [target(c) for c in plan.classes]
  t_min = min(c.degree for c in plan.classes)
  regroups = None
  if len(plan.classes) > 1:  # where each element is synced: chosen once, for every class
    regroups = plan_regroups(plan, [jax.eval_shape(unstack_local, t["params"])
                                    for _, t in targets])
  return PlanShapes(plan, meshes, targets, t_min, regroups)


class PlanPrograms:
  """Every program of a plan: each class's state placement and step, and the cross-class sync.

  Made from shapes only (``plan_shapes``), through ``cache``: ``build`` places
  the state and returns the class programs whose steps the job runs; ``lower``
  lowers the same objects (the steps and the sync under the keys ``build`` and
  ``job_step.JobStep`` look up, the ``placement.Placement``s of a source)
  ahead of time, so once they are compiled, building the plan and running its
  first step compile nothing.

  Args:
    plan: the plan. make_model: ``layouts -> module``; the same seed must give the
      same logical parameters for every layout.
    optimizer: the optax transformation. clip_norm: as ``train.clip_norm``.
    global_tokens: predicted tokens in one step, over every class.
    devices: the job's devices.
    cache: where every program is kept (default: a fresh ``ProgramCache``).
    loss: ``(module, tokens, targets) -> f32`` sum over a device's rows.
    optimizer_key: names the optimizer's settings in the cache keys
      (``steps.StepSettings``); default: the optimizer object.
    split: the gradient and update halves even with one class (``steps.SplitStep``),
      so that a multi-process job checks every process's arrival between them
      (``processes.arrival``).
    zero: the sharded optimizer (``zero.ZeroSettings``): the halves always, and ``lower``
      lowers its programs instead of the all-reduce and the replicated update.
    commits: the steps commit (``job_step.JobStep``'s ``commit``): the halves always, and
      ``lower`` lowers ``SplitStep.finish`` and ``apply_grads`` in place of ``update``.

  Raises:
    TypeError: the optimizer is not hashable and no ``optimizer_key`` is given.
  """

  def __init__(self, plan: Plan, make_model: Callable[[Any], nnx.Module],
               optimizer: optax.GradientTransformation, clip_norm: float, global_tokens: int,
               devices: Sequence[jax.Device], *, cache: ProgramCache | None = None,
               loss: Callable[..., Any] = default_loss, optimizer_key: Hashable | None = None,
               split: bool = False, zero: ZeroSettings | None = None, commits: bool = False):
    self.plan, self.make_model, self.optimizer = plan, make_model, optimizer
    self.split, self.zero, self.commits = split or zero is not None or commits, zero, commits
    self.settings = StepSettings(optimizer, clip_norm, global_tokens, loss, optimizer_key)
    self.cache = cache or ProgramCache()
    self.shapes = plan_shapes(plan, make_model, optimizer, devices, self.cache, self.settings)

  def step(self, i: int, *, record: bool = True) -> tuple[Hashable, ClassStep]:
    """``(cache key, step)`` of class ``i``, made from its abstract state in the class
    shardings (``sharded_abstract``) on a miss; ``record=False``: a lookup made ahead."""
    c, mesh = self.plan.classes[i], self.shapes.meshes[i]
    graphdef, target = self.shapes.targets[i]
    state = sharded_abstract(target, mesh)
    return cached_step(self.cache, c, graphdef, state["params"], state["opt_state"], mesh,
                       self.settings, classes=len(self.plan.classes) + self.split,
                       t_min=self.shapes.t_min, regroups=self.shapes.regroups, record=record)

  def placement(self, i: int, source: LogicalSource) -> Placement:
    """Class ``i``'s state from ``source`` (``placement.Placement``, programs in the cache)."""
    return Placement(self.shapes.targets[i][1], self.shapes.meshes[i], source, self.cache)

  def _init_opt_state(self, i: int, params: Any) -> Any:
    """Optimizer state of class ``i`` from ``optimizer.init`` in ``class_shardings``
    (moments follow their parameter, step counts replicated)."""
    c, mesh, (_, target) = self.plan.classes[i], self.shapes.meshes[i], self.shapes.targets[i]
    init = self.cache.program(
        ("optimizer init", c.layouts, len(c.replicas), self.settings.key, mesh),
        lambda: jax.jit(self.optimizer.init,
                        out_shardings=class_shardings(target["opt_state"], mesh)))
    return init(params)

  def abstract(self) -> list[ClassProgram]:
    """Every class's program with its state as ``ShapeDtypeStruct``s in the class shardings
    and its step: for lowering and XLA's analyses (``analysis.cost``). Nothing is placed
    or compiled."""
    programs = []
    for i, (replica_class, mesh, (graphdef, target)) in enumerate(
        zip(self.plan.classes, self.shapes.meshes, self.shapes.targets)):
      state = sharded_abstract(target, mesh)
      key, step = self.step(i)
      programs.append(ClassProgram(replica_class, mesh, graphdef, state["params"],
                                   state["opt_state"], step, key))
    return programs

  def build(self, source: LogicalSource | None = None) -> list[ClassProgram]:
    """Place every class's parameters and optimizer state and take its step.

    Args:
      source: logical state to start from (``ntp_jax.state.placement``): a
        checkpoint, a live replica, ...; default: fresh parameters of the
        degree-1 model (``InitSource``). Optimizer state the source does not
        hold starts from ``optimizer.init``. In a multi-process job a source that
        does not span processes is read over them (``LogicalSource.over_processes``,
        else ``spanning.SpanningSource``).

    Returns:
      One ``ClassProgram`` per class, in plan order (abstract state and no step for a
      class with no device in this process).

    Raises:
      ValueError: the source holds part of the optimizer state only.
      What the source's reads raise (``LookupError`` from live peers with no copy left,
      ``CheckpointError``, ...).
    """
    plan, shapes = self.plan, self.shapes
    if source is None:
      source = InitSource(lambda: self.make_model(plan.logical_layouts))
    if jax.process_count() > 1 and not source.spans_processes:
      # One collective read for every class (see ntp_jax.state.spanning); a source that
      # moves its own state across processes (live DP peers) says how.
      targets = [target for _, target in shapes.targets]
      source = (source.over_processes(targets, shapes.meshes, shapes.t_min)
                or SpanningSource(source, targets[0], shapes.meshes, shapes.t_min,
                                  cache=self.cache))
    programs = []
    for i, (replica_class, mesh, (graphdef, target)) in enumerate(
        zip(plan.classes, shapes.meshes, shapes.targets)):
      if not holds_mine(mesh):  # another process's class: its state stays abstract here
        programs.append(ClassProgram(replica_class, mesh, graphdef, target["params"],
                                     target["opt_state"]))
        continue
      state, filled = self.placement(i, source)()
      opt_paths = {p for p in filled if p[0] == "opt_state"}
      if not opt_paths:
        opt_state = self._init_opt_state(i, state["params"])
      elif len(opt_paths) == len(jax.tree.leaves(target["opt_state"])):
        opt_state = state["opt_state"]
      else:
        raise ValueError(f"optimizer state: the source holds {len(opt_paths)} of "
                         f"{len(jax.tree.leaves(target['opt_state']))} leaves")
      key, step = self.step(i)
      programs.append(ClassProgram(replica_class, mesh, graphdef, state["params"], opt_state,
                                   step, key))
    return programs

  def lower(self, seq_len: int, source: LogicalSource | None = None,
            skip: Collection[Hashable] = ()) -> list[tuple[str, Hashable, jax.stages.Lowered]]:
    """Every program a move onto the plan and its first step run, lowered ahead of time.

    Args:
      seq_len: tokens per sequence (the batch is int32 ``[class rows, seq_len + 1]``;
        ``global_tokens`` should be ``plan.global_batch * seq_len``).
      source: the state moved onto the plan (live DP peers, a checkpoint's shapes); its
        placements are included (``Placement.lower``; left out when the source cannot
        tell them). Several processes: first the moves that make the state span them
        (``LogicalSource.over_processes`` with ``run=False``). None: no state move.
      skip: cache keys of steps and syncs compiled already (a class shared by several
        reachable plans): left out.

    Returns:
      ``(what, cache key or None, lowered)`` per program, in the order a recovery
      needs them: state moves first, then each class's step, then the sync (with
      ``zero``, the sharded optimizer's programs and the metrics handoff,
      ``metrics_handoff``). Only classes with a device in this process.
    """
    moves, steps, blocks, first = [], [], [], None
    if source is not None and jax.process_count() > 1 and not source.spans_processes:
      # As build: the state spans the processes first, the source's own way (its moves
      # planned, not run); a source that reads over every process runs no program of ours
      # before the placements, but cannot tell them without reading: left out.
      try:
        spanning = source.over_processes([t for _, t in self.shapes.targets],
                                         self.shapes.meshes, self.shapes.t_min, run=False)
      except LookupError:  # no live copy of some piece: that recovery restores a checkpoint
        spanning = None
      if spanning is not None:
        moves += [("state move (across processes)", None, lowered)
                  for lowered in spanning.lower()]
      source = spanning
    for i, (replica_class, mesh, (_, target)) in enumerate(
        zip(self.plan.classes, self.shapes.meshes, self.shapes.targets)):
      if not holds_mine(mesh):
        continue
      name = class_label(replica_class)
      if source is not None:
        moves += [(f"state move ({name})", None, lowered)
                  for lowered in self.placement(i, source).lower() or []]
      key, step = self.step(i, record=False)
      state = sharded_abstract(target, mesh)
      batch = jax.ShapeDtypeStruct((replica_class.batch_rows, seq_len + 1), np.int32,
                                   sharding=NamedSharding(mesh, P(DP)))
      if key not in skip:
        if self.zero is not None:  # zero2: each micro-batch size's gradient half instead
          sizes = [size for _, size in micro_batches(replica_class.batch_share,
                                                     replica_class.microbatches)
                   ] if self.zero.stage == 2 else []
          lowered_step = step.lower_sharded(state["params"], batch, sizes)
        elif self.commits:
          lowered_step = step.lower_committed(state["params"], state["opt_state"], batch)
        else:
          lowered_step = step.lower(state["params"], state["opt_state"], batch)
        names = [f"class program ({name})"] * len(lowered_step)
        if self.commits and self.zero is None:  # its last program runs after the vote
          names[-1] += UPDATE_SUFFIX  # (checked for collectives)
        steps += [(what, key, lowered) for what, lowered in zip(names, lowered_step)]
      if isinstance(step, SplitStep):
        blocks.append(abstract_sync_blocks(step.grad, state["params"], batch, mesh))
        first = first or (step, state["params"])
    if self.zero is not None and blocks:
      sync_key, sync = cached_sync(self.cache, self.shapes.meshes, self.shapes.t_min,
                                   record=False)
      key, sharded = cached_sharded_optimizer(self.cache, sync_key, sync, self.zero,
                                              runs_of(first[0].leaves, self.zero, first[1]),
                                              record=False)
      if key not in skip:
        rounds = max(c.microbatches for c in self.plan.classes)
        steps += [(what + (UPDATE_SUFFIX if what == UPDATE_PROGRAM and self.commits else ""),
                   key, lowered) for what, lowered in sharded.lower_programs(blocks, rounds)]
      # The processes holding no core device get the update's metrics through their class.
      for i in metrics_handoff.handoff_classes(self.shapes.meshes, sync.mesh):
        mesh = self.shapes.meshes[i]
        if holds_mine(mesh) and metrics_handoff.cache_key(mesh) not in skip:
          steps.append((f"metrics handoff ({class_label(self.plan.classes[i])})",
                        metrics_handoff.cache_key(mesh), metrics_handoff.lower(self.cache, mesh)))
    elif (len(self.plan.classes) > 1 or self.split) and blocks:
      key, sync = cached_sync(self.cache, self.shapes.meshes, self.shapes.t_min, record=False)
      if key not in skip:
        steps.append(("cross-class sync", key, sync.lower(blocks)))
    return moves + steps


def build_class_programs(plan: Plan, make_model: Callable[[Any], nnx.Module],
                         optimizer: optax.GradientTransformation, clip_norm: float,
                         global_tokens: int, devices: Sequence[jax.Device], *,
                         source: LogicalSource | None = None,
                         cache: ProgramCache | None = None,
                         loss: Callable[..., Any] = default_loss,
                         optimizer_key: Hashable | None = None,
                         split: bool = False) -> list[ClassProgram]:
  """Place every class's parameters and optimizer state and make its step:
  ``PlanPrograms(...).build(source)`` (see there for the arguments).

  Raises:
    ValueError: the source holds part of the optimizer state only.
    TypeError: the optimizer is not hashable and no ``optimizer_key`` is given.
  """
  return PlanPrograms(plan, make_model, optimizer, clip_norm, global_tokens, devices,
                      cache=cache, loss=loss, optimizer_key=optimizer_key,
                      split=split).build(source)


def sharded_abstract(target: Any, mesh: Mesh) -> Any:
  """``target`` (abstract class state) as ``ShapeDtypeStruct``s carrying the class shardings
  (``class_shardings``): what the placed state will look like to ``jax.jit``."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      target, class_shardings(target, mesh))


def class_label(replica_class: ReplicaClass) -> str:
  """``TP degree 3, replicas [0]``: one replica class in logs and program descriptions."""
  return f"TP degree {replica_class.degree}, replicas {list(replica_class.replicas)}"


def cached_step(cache: ProgramCache, replica_class: ReplicaClass, graphdef: nnx.GraphDef,
                params: Any, opt_state: Any, mesh: Mesh, settings: StepSettings, *,
                classes: int, t_min: int, regroups: dict | None, record: bool = True
                ) -> tuple[Hashable, ClassStep]:
  """``(key, step)``: the class's step from ``cache``, made on a miss: fused with one
  class, split with several.

  Keyed by the mesh (devices), the class's layouts, ``t_min``, the step
  settings' ``key``, the batch share and its micro-batches, and (split) the
  regroups: everything the compiled programs depend on.
  """
  fused = classes == 1
  # The share (the batch's shape) and its micro-batches decide the compiled program too.
  key = (mesh, replica_class.layouts, fused, t_min, settings.key, replica_class.batch_share,
         replica_class.microbatches)
  what = f"class program ({class_label(replica_class)})"
  micro = dict(microbatches=replica_class.microbatches)
  if fused:
    return key, cache.get(key, what, lambda: FusedStep.build(graphdef, params, opt_state, mesh,
                                                             settings, **micro), record=record)
  key += (tuple(sorted((regroups or {}).items())),)
  return key, cache.get(key, what, lambda: SplitStep.build(graphdef, params, opt_state, mesh,
                                                           settings, t_min, regroups, **micro),
                        record=record)


def cached_sync(cache: ProgramCache, meshes: Sequence[Mesh], t_min: int, *,
                record: bool = True) -> tuple[Hashable, CrossClassSync]:
  """``(key, sync)``: the cross-class sync over ``meshes`` from ``cache``."""
  key = ("sync", tuple(meshes), t_min)
  return key, cache.get(key, "cross-class sync", lambda: CrossClassSync(list(meshes), t_min),
                        record=record)


def logical_state(programs: list[ClassProgram], cache: ProgramCache | None = None) -> dict:
  """The job's state in logical form (``placement.read_logical`` of the first class).

  Every replica holds identical state, so one replica's copy is the job's. In
  a multi-process job the arrays span every replica (``spanning``), each
  process holding its own devices' pieces, as orbax's collective save wants.
  ``cache``: where the programs are kept (the run's; default: a fresh one).
  """
  if jax.process_count() > 1:
    t_min = min(p.replica_class.degree for p in programs)
    return read_logical_spanning(
        [({"params": p.params, "opt_state": p.opt_state}, p.mesh) for p in programs], t_min,
        cache)
  program = programs[0]
  return read_logical({"params": program.params, "opt_state": program.opt_state}, program.mesh,
                      cache=cache)


def live_rows(program: ClassProgram, processes: Collection[int], *, partial: bool = False,
              shapes_only: bool = False) -> ClassProgram | None:
  """``program``'s state cut to the replicas whose devices all belong to ``processes`` (the
  live ones), on a mesh of those rows only: no program run on it touches a lost process.
  None when no replica is left. The step is dropped (the state is for moving, not training).

  ``partial``: the replicas with at least one device in ``processes`` are kept too. For a
  live move, which reads single devices' buffers and never a lost one (the caller counts the
  lost processes' devices as dead): two replicas each missing different slots hold every
  unit between them.

  Each array keeps its sharding's spec; a replica-stacked leaf keeps the rows' blocks, a
  replicated one its copies; nothing is copied. Abstract where another process holds the
  rows, and everywhere with ``shapes_only`` (``jax.ShapeDtypeStruct``s with the cut
  shardings: for lowering the moves of a loss ahead of it, no buffer touched).
  """
  live = set(processes)
  kept = (lambda row: processes_of(row) & live) if partial else (
      lambda row: processes_of(row) <= live)
  return keep_rows(program, [r for r, row in enumerate(program.mesh.devices) if kept(row)],
                   shapes_only=shapes_only)


def keep_rows(program: ClassProgram, rows: Sequence[int], *,
              shapes_only: bool = False) -> ClassProgram | None:
  """``program``'s state cut to its replicas ``rows`` (indices into its mesh's rows, in
  order) on a mesh of those rows only, as ``live_rows`` cuts it; None when ``rows`` is
  empty."""
  if not rows:
    return None
  if len(rows) == program.mesh.devices.shape[0]:
    return dataclasses.replace(program, step=None, key=None)
  sub = Mesh(program.mesh.devices[rows], program.mesh.axis_names)
  held = [d for d in sub.devices.flat if is_mine(d)]

  def cut(x):
    stacked = isinstance(getattr(x, "sharding", None), NamedSharding) and (
        len(x.sharding.spec) > 0 and x.sharding.spec[0] == DP)
    shape = (len(rows),) + tuple(x.shape[1:]) if stacked else tuple(x.shape)
    if shapes_only and isinstance(getattr(x, "sharding", None), NamedSharding):
      return jax.ShapeDtypeStruct(shape, x.dtype, sharding=NamedSharding(sub, x.sharding.spec))
    if not isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(shape, x.dtype)
    by_device = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(
        shape, NamedSharding(sub, x.sharding.spec), [by_device[d] for d in held], dtype=x.dtype)

  return dataclasses.replace(program, mesh=sub, params=jax.tree.map(cut, program.params),
                             opt_state=jax.tree.map(cut, program.opt_state), step=None, key=None)


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
    processes = processes_of(program.mesh)
    if not processes <= covered:
      chosen.append(i)
      covered |= processes
  return chosen
