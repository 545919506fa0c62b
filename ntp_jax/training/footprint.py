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
from ntp_jax.parallel.plan import Plan, ReplicaClass
from ntp_jax.parallel.programs import ClassProgram, abstract_class_state, class_shardings
from ntp_jax.parallel.steps import FusedStep, SplitStep, StepSettings, default_loss
from ntp_jax.sharding.mesh import class_mesh


@dataclasses.dataclass(frozen=True)
class ClassFootprint:
  """One device of one replica class in one step (bytes and flops per device).

  Attributes:
    replica_class: the class.
    params: parameter bytes (its padded blocks and replicated variables).
    opt_state: optimizer state bytes (Adam moments follow their parameter).
    temp: XLA's temporary buffers of the step (activations kept for the
      backward pass, gradients, workspace); with several classes the larger
      of the gradient and update programs.
    batch: token bytes of the class's batch rows.
    outputs: step outputs not written in place of a donated input.
    flops: flops per device per step (None when not computed).
  """

  replica_class: ReplicaClass
  params: int
  opt_state: int
  temp: int
  batch: int
  outputs: int
  flops: float | None = None

  @property
  def grads(self) -> int:
    """Gradient bytes: the parameters' shapes and dtype (live inside the step, so also
    part of ``temp``)."""
    return self.params

  @property
  def peak(self) -> int:
    """Bytes a device needs: resident state, the batch, step temporaries and fresh outputs."""
    return self.params + self.opt_state + self.batch + self.temp + self.outputs


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


def class_footprints(plan: Plan, make_model: Callable[[Any], nnx.Module],
                     optimizer: optax.GradientTransformation, clip_norm: float, seq_len: int,
                     devices: Sequence[jax.Device], loss: Callable[..., Any] = default_loss,
                     unrolled: bool = False) -> list[ClassFootprint]:
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

  Returns:
    One ``ClassFootprint`` per class; ``flops`` is XLA's cost analysis of the
    program as compiled (a scanned loop body counted once: see
    ``per_device_flops``).
  """
  settings = StepSettings(optimizer, clip_norm, plan.global_batch * seq_len, loss)
  t_min = min(c.degree for c in plan.classes)
  out = []
  for replica_class in plan.classes:
    program, batch = abstract_program(plan, replica_class, make_model, optimizer, seq_len,
                                      devices)
    state = (program.graphdef, program.params, program.opt_state, program.mesh, settings)
    # Split halves with near-equal sync runs (regroups=None), not the job's regroup_plan.
    micro = dict(microbatches=replica_class.microbatches, scan_microbatches=not unrolled)
    step = (FusedStep.build(*state, **micro) if len(plan.classes) == 1
            else SplitStep.build(*state, t_min, **micro))
    compiled = [lowered.compile() for lowered in step.lower(program.params, program.opt_state,
                                                            batch)]
    memory = [c.memory_analysis() for c in compiled]
    params = device_bytes(program.params)
    out.append(ClassFootprint(
        replica_class=replica_class, params=params,
        opt_state=device_bytes(program.opt_state),
        temp=max(int(m.temp_size_in_bytes) for m in memory),
        batch=device_bytes(batch),
        outputs=max(int(m.output_size_in_bytes - m.alias_size_in_bytes) for m in memory),
        flops=sum(flops_of(c) for c in compiled)))
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
  ``bytes_limit`` bounds each device's peak.
  """
  if devices[0].platform == "cpu":
    need = sum(f.peak * f.replica_class.degree * len(f.replica_class.replicas)
               for f in footprints)
    have = host_memory_available()
    if have is not None and need > have:
      return (f"the plan needs {need / 2**30:.1f} GiB of host memory for "
              f"{sum(f.replica_class.degree * len(f.replica_class.replicas) for f in footprints)}"
              f" CPU devices, {have / 2**30:.1f} GiB available")
    return None
  capacity = device_capacity(devices[0])
  worst = max(footprints, key=lambda f: f.peak)
  if capacity is not None and worst.peak > capacity:
    return (f"the plan needs {worst.peak / 2**30:.1f} GiB per device (class TP degree "
            f"{worst.replica_class.degree}), a {devices[0].device_kind} holds "
            f"{capacity / 2**30:.1f} GiB; try model.remat=full, a smaller train.batch_size, "
            "or more devices")
  return None


def footprint_table(footprints: Sequence[ClassFootprint]) -> str:
  """One row per class: per-device GiB of each part, peak, and TFLOP per step."""
  header = ("class", "TP degree", "replicas", "params", "grads", "opt state", "temp",
            "peak", "TFLOP/step")
  rows = []
  for f in footprints:
    c = f.replica_class
    flops = "-" if f.flops is None else f"{f.flops / 1e12:.3f}"
    rows.append((str(c.index), str(c.degree), ",".join(map(str, c.replicas)),
                 *(f"{b / 2**30:.3f}" for b in (f.params, f.grads, f.opt_state, f.temp,
                                                 f.peak)), flops))
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
  fmt = "  ".join(f"{{:>{w}}}" for w in widths)
  lines = ["per device (GiB), one step:", fmt.format(*header)]
  lines += [fmt.format(*r) for r in rows]
  return "\n".join(lines)
