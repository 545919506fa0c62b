"""Per-device memory and flops of a plan's training step, from abstract shapes.

Each class's step is lowered and compiled for ``jax.ShapeDtypeStruct``
arguments carrying the class shardings: nothing is allocated, so the figures
of a model far larger than the machine (gpt_8b on a CPU host) come out in the
time of a compile. Parameter and optimizer-state bytes per device are the
shard shapes of the class state (one padded block per device, the largest
slot's size); temporaries and argument/output sizes are XLA's memory
analysis of the compiled SPMD program, which describes one device; flops are
XLA's cost analysis of the same program (see ``per_device_flops`` for scanned
layers).

The optimizer state is counted as the run keeps it: replicated (the class
state's moments, on every replica), or with
``train.optimizer_sharding=zero1`` or ``zero2`` (a ``zero.ZeroSettings``) the sharded
state a core device holds (float32 master weights and Adam moments, one
piece of each sync buffer: ``ShardedOptimizer.abstract_state``);
its temporaries and outputs are then those of the programs zero1 runs, each
class's gradient half (``SplitStep.grad``) and the sharded optimizer's
reduction, update and gathering (``ShardedOptimizer.lower_step``); with
``zero2``, one micro-batch's gradient half (``SplitStep.micro_grad``) and a
reduction per micro-batch into the summed pieces.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from ntp_jax.analysis.cost import flops_of
from ntp_jax.errors import ConfigError
from ntp_jax.model import ModelSpec
from ntp_jax.parallel.accumulate import micro_batches
from ntp_jax.parallel.plan import Plan, ReplicaClass
from ntp_jax.parallel.programs import (
  ClassProgram,
  abstract_class_state,
  abstract_params,
  class_shardings,
)
from ntp_jax.parallel.steps import (
  FusedStep,
  SplitStep,
  StepSettings,
  abstract_sync_blocks,
  default_loss,
)
from ntp_jax.parallel.sync import CrossClassSync, plan_regroups
from ntp_jax.parallel.sync_leaf import (
  INT32_MAX,
  buffer_dtype,
  buffer_shapes,
  int32_overrun,
  sync_leaves,
)
from ntp_jax.parallel.zero import ShardedOptimizer, ZeroSettings, piece_count
from ntp_jax.sharding.mesh import class_mesh


@dataclasses.dataclass(frozen=True)
class ClassFootprint:
  """One device of one replica class in one step (bytes and flops per device).

  Attributes:
    replica_class: the class.
    params: parameter bytes (its padded blocks and replicated variables).
    opt_state: optimizer state bytes: replicated, the class state's (Adam
      moments follow their parameter); zero1/zero2, a core device's piece of the
      sharded state (the most any device of the class holds; devices past
      the core slots hold none).
    temp: XLA's temporary buffers of the step (activations kept for the
      backward pass, gradients, workspace); with several programs (several
      classes, or zero1/zero2) the largest of theirs.
    batch: token bytes of the class's batch rows.
    outputs: step outputs not written in place of a donated input: the
      largest of the programs'; zero1/zero2, the larger of a round's gradient
      buffers beside the float32 summed pieces (the reduction's argument and
      result) and the gathered parameters (the buffers and the pieces are
      gone by then).
    flops: flops per device per step (None when not computed).
    optimizer: how the optimizer state is held (``optimizer_label``).
    read_back: zero1/zero2: bytes beside the parameters and the pieces while a checkpoint
      save or a live move reads the sharded state back into the class layout
      (``ShardedOptimizer.class_opt_states``): the whole class-layout state, the class's
      float32 packed buffers (the unpacking's templates), and one moment's gathered
      float32 buffers with the gathering's temporaries (the unpacking's own temporaries
      left out); 0 when replicated (the state is saved and moved as held).
  """

  replica_class: ReplicaClass
  params: int
  opt_state: int
  temp: int
  batch: int
  outputs: int
  flops: float | None = None
  optimizer: str = "replicated"
  read_back: int = 0

  @property
  def grads(self) -> int:
    """Gradient bytes: the parameters' shapes and dtype (live inside the step, so also
    part of ``temp``)."""
    return self.params

  @property
  def peak(self) -> int:
    """Bytes a device needs: resident state, the batch, step temporaries and fresh outputs."""
    return self.params + self.opt_state + self.batch + self.temp + self.outputs

  @property
  def save_peak(self) -> int:
    """Bytes a device needs while a save or a live move reads the state back (``read_back``;
    between steps: no batch, temporaries or outputs of the step)."""
    return self.params + self.opt_state + self.read_back

  @property
  def need(self) -> int:
    """The most a device needs, in a step or in a save."""
    return max(self.peak, self.save_peak)


# These programs are analysed, never run: skip the backend's code optimisation (LLVM), which
# is most of a CPU compile and changes neither XLA's buffer assignment nor its cost analysis.
ANALYSIS_ONLY = {"xla_backend_optimization_level": 0}


def device_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of sharded ``ShapeDtypeStruct``s (its largest shard)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape)
    total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
  return total


def _with_shardings(abstract: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract, shardings)


def abstract_program(plan: Plan, replica_class: ReplicaClass,
                     make_model: Callable[[Any], nnx.Module],
                     optimizer: optax.GradientTransformation, seq_len: int,
                     devices: Sequence[jax.Device]) -> tuple[ClassProgram, jax.ShapeDtypeStruct]:
  """A class program whose state and batch are sharded ``ShapeDtypeStruct``s (no buffers).

  Its ``step`` is None: ``FusedStep.build`` or ``SplitStep.build`` from its state gives the
  step, whose ``lower`` with these arguments compiles the real programs.
  """
  mesh = class_mesh(replica_class.replicas, replica_class.live_slots, plan.tp, devices)
  graphdef, target = abstract_class_state(lambda: make_model(replica_class.layouts),
                                          len(replica_class.replicas), optimizer)
  state = _with_shardings(target, class_shardings(target, mesh))
  program = ClassProgram(replica_class, mesh, graphdef, state["params"], state["opt_state"])
  batch = jax.ShapeDtypeStruct((replica_class.batch_rows, seq_len + 1), np.int32,
                               sharding=program.batch_sharding)
  return program, batch


def optimizer_label(zero: ZeroSettings | None, replicas: int) -> str:
  """``replicated``, or ``zero1 k=2 (2 pieces)`` (``zero2 ...``): the optimizer state's
  layout over
  ``replicas`` live replicas.

  Raises:
    ValueError: more copies than replicas (``piece_count``).
  """
  if zero is None:
    return "replicated"
  pieces = piece_count(replicas, zero.copies)
  return f"{zero.name} k={zero.copies} ({pieces} piece{'s' if pieces > 1 else ''})"


def sync_buffer_lengths(plan: Plan, make_model: Callable[[Any], nnx.Module]
                        ) -> dict[str, tuple[int, ...]]:
  """``buffer name -> shape`` of each sync buffer at one core position
  (``sync_leaf.buffer_shapes``: ``(L,)``, or ``(layers, L)`` for stacked parameters; near-equal
  runs at ``t_min`` positions), the same for every class. Shapes only."""
  t_min = min(c.degree for c in plan.classes)
  c = plan.classes[0]
  return buffer_shapes(sync_leaves(abstract_params(lambda: make_model(c.layouts)), c.degree,
                                   t_min))


def split_step_overrun(plan: Plan, make_model: Callable[[Any], nnx.Module],
                       sharded: bool) -> str | None:
  """Why ``plan``'s split step (and, ``sharded``, the sharded optimizer over its buffers)
  cannot be built, in words, from shapes: a run it would index past ``2**31 - 1`` elements
  on one device (``sync_leaf.int32_overrun``); None when it can."""
  t_min = min(c.degree for c in plan.classes)
  for c in plan.classes:
    leaves = sync_leaves(abstract_params(lambda c=c: make_model(c.layouts)), c.degree, t_min)
    overrun = int32_overrun(leaves, sharded)
    if overrun is not None:
      return (f"the split step at TP degree {c.degree} would index {overrun[1]:,} elements "
              f"of {overrun[0]} per device with int32 (at most {INT32_MAX:,})")
  return None


def check_split_step(plan: Plan, model: ModelSpec, sharded: bool) -> None:
  """Refuse, before building it, a plan whose split step (replicas of several TP degrees,
  the sharded optimizer, or a multi-process job's halves) cannot be built: int32 index
  arithmetic past ``2**31 - 1`` elements (``split_step_overrun``). A model under
  ``INT32_MAX / 2`` parameters never reaches it and is not looked at.

  Raises:
    ConfigError: one line naming the parameter or buffer and its elements.
  """
  if 2 * model.param_count <= INT32_MAX:  # no leaf nor buffer can reach the bound
    return
  overrun = split_step_overrun(plan, model.make, sharded)
  if overrun is not None:
    degrees = [r.degree for r in plan.replicas]
    raise ConfigError(f"model: {model.name} on the plan with TP degrees {degrees}: {overrun}; "
                      "a healthy plan with train.optimizer_sharding=replicated runs one fused "
                      "step, which has no such bound")


def failure_overrun(plan: Plan, failed: frozenset[tuple[int, int]],
                    failed_plan: Callable[[frozenset], Plan], model: ModelSpec,
                    sharded: bool) -> str | None:
  """Why a failure would stop a run of ``plan`` (one line), or None: the plan one more
  failed slot leads to (``failed_plan(failed | {slot})``, ``failed`` the plan's failed
  ``(replica, slot)`` pairs, the slot the last live one of the first replica of two or
  more) needs a split step that cannot be built (``split_step_overrun``). Checked for
  models of ``INT32_MAX / 2`` parameters or more only."""
  if 2 * model.param_count <= INT32_MAX:
    return None
  replica = next((r for r in plan.replicas if r.degree > 1), None)
  if replica is None:
    return None
  after = failed_plan(frozenset(failed) | {(replica.replica, replica.live_slots[-1])})
  overrun = split_step_overrun(after, model.make, sharded)
  if overrun is None:
    return None
  return (f"a failed slot would stop this run: on the plan it leads to (TP degrees "
          f"{[r.degree for r in after.replicas]}) {overrun}")


def memoized_split_step_overrun(memo: dict, plan: Plan, make_model: Callable[[Any], nnx.Module],
                                sharded: bool) -> str | None:
  """``split_step_overrun`` kept in ``memo`` (one model depth's memo, as
  ``class_footprints`` takes it) under the plan's classes."""
  key = ("split step overrun", plan.classes, sharded)
  if key not in memo:
    memo[key] = split_step_overrun(plan, make_model, sharded)
  return memo[key]


def memoized_sync_lengths(memo: dict, plan: Plan, make_model: Callable[[Any], nnx.Module]
                          ) -> dict[str, tuple[int, ...]]:
  """``sync_buffer_lengths`` kept in ``memo`` (one model depth's memo, as
  ``class_footprints`` takes it) under the plan's classes."""
  key = ("sync lengths", plan.classes)
  if key not in memo:
    memo[key] = sync_buffer_lengths(plan, make_model)
  return memo[key]


def sharded_optimizer(plan: Plan, devices: Sequence[jax.Device],
                      zero: ZeroSettings) -> ShardedOptimizer:
  """The ``ShardedOptimizer`` a run of ``plan`` uses, over meshes alone (no arrays).

  Raises:
    ValueError: more copies than live replicas.
  """
  meshes = [class_mesh(c.replicas, c.live_slots, plan.tp, devices) for c in plan.classes]
  # Which elements decay changes no buffer (the program computes it from static runs).
  return ShardedOptimizer(CrossClassSync(meshes, min(c.degree for c in plan.classes)), zero,
                          runs=())


def _position_blocks(shapes: dict[str, tuple[int, ...]]) -> dict[str, jax.ShapeDtypeStruct]:
  """One position's sync buffers (``sync_buffer_lengths``) as ``[1, 1, ...]`` abstract arrays."""
  return {name: jax.ShapeDtypeStruct((1, 1, *shape), buffer_dtype(name))
          for name, shape in shapes.items()}


def zero_state_bytes(plan: Plan, make_model: Callable[[Any], nnx.Module],
                     devices: Sequence[jax.Device], zero: ZeroSettings) -> int:
  """Bytes one core device holds of the sharded optimizer state (pieces and step counts),
  as ``ShardedOptimizer.start`` makes it; shapes only, nothing compiled.

  Raises:
    ValueError: more copies than live replicas.
  """
  blocks = _position_blocks(sync_buffer_lengths(plan, make_model))
  return device_bytes(sharded_optimizer(plan, devices, zero).abstract_state([blocks]))


def piece_element_bytes(plan: Plan, make_model: Callable[[Any], nnx.Module],
                        devices: Sequence[jax.Device], zero: ZeroSettings,
                        lengths: dict[str, tuple[int, ...]] | None = None) -> dict[str, int]:
  """``buffer name -> bytes`` the sharded state keeps per element of that sync buffer's piece
  (master weights, moments), read from ``ShardedOptimizer.abstract_state``:
  with ``sync_buffer_lengths`` (``lengths``, computed when not given) it gives the state at
  any replica count."""
  if lengths is None:
    lengths = sync_buffer_lengths(plan, make_model)
  blocks = _position_blocks(lengths)
  state = sharded_optimizer(plan, devices, zero).abstract_state([blocks])
  out = dict.fromkeys(blocks, 0)
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in out]
    if x.ndim and names:
      out[names[-1]] += np.dtype(x.dtype).itemsize
  return out


def class_footprints(plan: Plan, make_model: Callable[[Any], nnx.Module],
                     optimizer: optax.GradientTransformation, clip_norm: float, seq_len: int,
                     devices: Sequence[jax.Device], loss: Callable[..., Any] = default_loss,
                     unrolled: bool = False, *, zero: ZeroSettings | None = None,
                     compiled: dict | None = None) -> list[ClassFootprint]:
  """Compile every class's step for abstract arguments and measure one device of each.

  Args:
    plan: the NTP plan (classes, batch shares).
    make_model: ``layouts -> module``; loss: as ``ModelSpec.loss``.
    optimizer, clip_norm: as for training.
    seq_len: tokens per sequence.
    devices: the job's devices (the meshes are built on them; nothing is
      placed there).
    unrolled: run micro-batches in a Python loop, not under ``lax.scan``, so
      that the flops count every one (pass with an unrolled model).
    zero: the sharded optimizer (``train.optimizer_sharding=zero1`` or ``zero2``,
      ``optim.zero_settings``); None: replicated. With it the classes run their
      gradient halves (zero2: per micro-batch) and the sharded update
      (``ShardedOptimizer.lower_step``), and ``opt_state`` is a core device's piece
      of the sharded state.
    compiled: a memo of compiled programs, for several calls on the same model,
      optimizer and ``seq_len`` (a gradient half is compiled once for every choice of
      ``zero``); default: none kept.

  Returns:
    One ``ClassFootprint`` per class; ``flops`` is XLA's cost analysis of the
    program as compiled (a scanned loop body counted once: see
    ``per_device_flops``); with ``zero`` each class's flops include the sharded
    update's (a core device's; zero2, and a reduction per micro-batch round).

  Raises:
    ValueError: ``zero`` asks for more copies than live replicas.
    OverflowError: the split step would index more than ``2**31 - 1`` elements of one
      layer's run with int32 (``split_step_overrun``), found from the shapes before
      compiling anything.
  """
  memo = {} if compiled is None else compiled
  settings = StepSettings(optimizer, clip_norm, plan.global_batch * seq_len, loss)
  t_min = min(c.degree for c in plan.classes)
  split = len(plan.classes) > 1 or zero is not None
  label = optimizer_label(zero, len(plan.replicas))
  if split:  # known from shapes, before tracing or compiling anything
    overrun = memoized_split_step_overrun(memo, plan, make_model, zero is not None)
    if overrun is not None:
      raise OverflowError(overrun)

  def compile_once(key, jitted, *args, **static):
    key = (plan.classes, seq_len, unrolled) + key
    if key not in memo:
      memo[key] = jitted.lower(*args, **static).compile(compiler_options=ANALYSIS_ONLY)
    return memo[key]

  regroups = None  # the sync positions the job uses (``programs.plan_shapes``)
  if len(plan.classes) > 1:
    key = (plan.classes, "regroups")
    if key not in memo:
      memo[key] = plan_regroups(plan, [abstract_params(lambda c=c: make_model(c.layouts))
                                       for c in plan.classes])
    regroups = memo[key]
  classes, rounds = [], 1
  for i, replica_class in enumerate(plan.classes):
    runs = None  # zero2: how many micro-batches of each compiled size the class runs
    if (plan.classes, seq_len, "abstract", i) not in memo:  # the same for every choice
      memo[plan.classes, seq_len, "abstract", i] = abstract_program(
          plan, replica_class, make_model, optimizer, seq_len, devices)
    program, batch = memo[plan.classes, seq_len, "abstract", i]
    state = (program.graphdef, program.params, program.opt_state, program.mesh, settings)
    micro = dict(microbatches=replica_class.microbatches, scan_microbatches=not unrolled)
    if not split:
      step = FusedStep.build(*state, **micro)
      programs = [compile_once((i, "fused"), step.step, program.params, program.opt_state,
                               batch)]
    elif zero is not None and zero.stage == 2:  # one micro-batch's gradient half per size
      step = SplitStep.build(*state, t_min, regroups, **micro)
      sizes = micro_batches(replica_class.batch_share, replica_class.microbatches)
      start = jax.ShapeDtypeStruct((), np.int32)
      programs = [compile_once((i, "micro", size), step.micro_grad, program.params, batch,
                               start, size=size) for _, size in sizes]
      runs = [n for n, _ in sizes]
    else:
      step = SplitStep.build(*state, t_min, regroups, **micro)
      programs = [compile_once((i, "grad"), step.grad, program.params, batch)]
      if zero is None:  # the replicated update half (zero runs the sharded update instead)
        blocks = abstract_sync_blocks(step.grad, program.params, batch, program.mesh)
        programs.append(compile_once((i, "update"), step.update, program.params,
                                     program.opt_state, blocks))
    classes.append((program, batch, step, programs, runs))
    rounds = max(rounds, replica_class.microbatches)

  update, opt_bytes = None, None
  if zero is not None:
    sharded = sharded_optimizer(plan, devices, zero)
    if (plan.classes, seq_len, unrolled, "blocks") not in memo:  # traces each gradient half
      memo[plan.classes, seq_len, unrolled, "blocks"] = [
          abstract_sync_blocks(step.grad, program.params, batch, program.mesh)
          for program, batch, step, _, _ in classes]
    blocks = memo[plan.classes, seq_len, unrolled, "blocks"]
    # Keyed by what the memo's contract leaves open (the optimizer's settings are fixed).
    key = (plan.classes, seq_len, unrolled, "zero", zero.copies, zero.clip_norm, zero.stage)
    if key not in memo:
      memo[key] = [lowered.compile(compiler_options=ANALYSIS_ONLY)
                   for _, lowered in sharded.lower_step(blocks, rounds)]
    update, runs_of_update = memo[key], sharded.step_runs(rounds)
    key = (plan.classes, seq_len, unrolled, "gather", zero.copies)
    if key not in memo:
      memo[key] = sharded.lower_gather(blocks).compile(compiler_options=ANALYSIS_ONLY)
    gather = memo[key].memory_analysis()
    gathering = int(gather.output_size_in_bytes + gather.temp_size_in_bytes)
    # class_opt_states keeps each class's float32 packed buffers as templates throughout.
    templates = [device_bytes(jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, np.float32, sharding=x.sharding), b)) for b in blocks]
    state = sharded.abstract_state(blocks)
    opt_bytes = device_bytes(state)
    total_bytes = device_bytes(state["master"])  # zero2's summed pieces: one per element

  out = []
  for i, (program, batch, _, programs, runs) in enumerate(classes):
    memory = [c.memory_analysis() for c in programs]
    fresh = [int(m.output_size_in_bytes - m.alias_size_in_bytes) for m in memory]
    if runs is None:
      flops = sum(flops_of(c) for c in programs)
    else:  # each micro-batch size's program as often as the class runs it
      flops = sum(n * flops_of(c) for n, c in zip(runs, programs))
    if update is None:
      temp, outputs, opt = (max(int(m.temp_size_in_bytes) for m in memory), max(fresh),
                            device_bytes(program.opt_state))
    else:
      # lower_step's order: the reductions, the norm, the update, the gathering of the
      # parameters (last).
      sharded_memory = [c.memory_analysis() for c in update]
      temp = max(int(m.temp_size_in_bytes) for m in memory + sharded_memory)
      last = sharded_memory[-1]
      gathered = int(last.output_size_in_bytes - last.alias_size_in_bytes)
      opt = opt_bytes
      # The summed pieces live beside a round's buffers until the update; the gathered
      # parameters come after both are gone.
      outputs = max(max(fresh) + total_bytes, gathered)
      flops += sum(n * flops_of(c) for n, c in zip(runs_of_update, update, strict=True))
    read_back = (0 if update is None else
                 device_bytes(program.opt_state) + gathering + templates[i])
    out.append(ClassFootprint(
        replica_class=program.replica_class, params=device_bytes(program.params),
        opt_state=opt, temp=temp, batch=device_bytes(batch), outputs=outputs, flops=flops,
        optimizer=label, read_back=read_back))
  return out


def per_device_flops(flops_at: Callable[[int], Sequence[float]], n_layers: int) -> list[float]:
  """Flops per device of each class for ``n_layers`` identical layers, from small compiles.

  XLA's cost analysis counts a loop body once, so a scanned stack is
  measured unrolled at 2 and 3 layers and extended linearly (the layers are
  identical): ``f(n) = f(2) + (n - 2) * (f(3) - f(2))``. One layer is not
  used as a base: with one layer the stacked parameters need no split, so its
  program differs from the others by more than a layer.

  Args:
    flops_at: ``layers -> per-class flops`` of the unrolled model.
  """
  if n_layers <= 3:
    return list(flops_at(n_layers))
  two = np.asarray(flops_at(2), dtype=np.float64)
  three = np.asarray(flops_at(3), dtype=np.float64)
  return (two + (n_layers - 2) * (three - two)).tolist()


def host_memory_available() -> int | None:
  """Bytes the host can still give (``MemAvailable`` of ``/proc/meminfo``), or None."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError):
    return None


def device_capacity(device: jax.Device) -> int | None:
  """Bytes one accelerator can hold (``memory_stats()['bytes_limit']``), or None if unknown."""
  try:
    stats = device.memory_stats()
  except Exception:  # platforms without memory stats raise various errors
    return None
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def resident_fraction(plan: Plan, resident: Sequence[int],
                      devices: Sequence[jax.Device]) -> float | None:
  """Share of the devices' memory that ``resident`` bytes per device of each class take.

  On CPU the devices share the host's available memory (summed over every
  live device); on an accelerator it is the fullest device against its
  ``bytes_limit``. None when the capacity is unknown.
  """
  if devices[0].platform == "cpu":
    have = host_memory_available()
    need = sum(r * c.degree * len(c.replicas) for r, c in zip(resident, plan.classes))
  else:
    have, need = device_capacity(devices[0]), max(resident)
  return None if not have else need / have


def shortfall(footprints: Sequence[ClassFootprint], devices: Sequence[jax.Device]) -> str | None:
  """Why the devices cannot hold the plan, in one line, or None when they can.

  CPU devices (real or simulated) share host memory: the sum over every live
  device must fit in what the host has available. An accelerator's
  ``bytes_limit`` bounds each device's peak (``ClassFootprint.need``: a step's or a
  save's, whichever is larger).
  """
  if devices[0].platform == "cpu":
    need = sum(f.need * f.replica_class.degree * len(f.replica_class.replicas)
               for f in footprints)
    have = host_memory_available()
    if have is not None and need > have:
      return (f"the plan needs {need / 2**30:.1f} GiB of host memory for "
              f"{sum(f.replica_class.degree * len(f.replica_class.replicas) for f in footprints)}"
              f" CPU devices, {have / 2**30:.1f} GiB available")
    return None
  capacity = device_capacity(devices[0])
  worst = max(footprints, key=lambda f: f.need)
  if capacity is not None and worst.need > capacity:
    during = "" if worst.need == worst.peak else " to save its optimizer state"
    return (f"the plan needs {worst.need / 2**30:.1f} GiB per device{during} (class TP degree "
            f"{worst.replica_class.degree}), a {devices[0].device_kind} holds "
            f"{capacity / 2**30:.1f} GiB; try model.remat=full, a smaller train.batch_size, "
            "or more devices")
  return None


def footprint_table(footprints: Sequence[ClassFootprint]) -> str:
  """One row per class: per-device GiB of each part, the step's peak, a save's peak
  (``ClassFootprint.save_peak``), and TFLOP per step (the title names a sharded optimizer
  state)."""
  header = ("class", "TP degree", "replicas", "params", "grads", "opt state", "temp",
            "outputs", "peak", "save peak", "TFLOP/step")
  rows = []
  for f in footprints:
    c = f.replica_class
    flops = "-" if f.flops is None else f"{f.flops / 1e12:.3f}"
    rows.append((str(c.index), str(c.degree), ",".join(map(str, c.replicas)),
                 *(f"{b / 2**30:.3f}" for b in (f.params, f.grads, f.opt_state, f.temp,
                                                 f.outputs, f.peak, f.save_peak)), flops))
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
  fmt = "  ".join(f"{{:>{w}}}" for w in widths)
  held = {f.optimizer for f in footprints} - {"replicated"}
  title = "per device (GiB), one step"
  if held:  # a sharded state: say so (a core device's piece is counted)
    title += f" (optimizer state {', '.join(sorted(held))}, a core device's piece)"
  lines = [f"{title}:", fmt.format(*header)]
  lines += [fmt.format(*r) for r in rows]
  return "\n".join(lines)
