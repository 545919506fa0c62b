"""The sharded update's metrics handed to the processes that hold no core device.

With a sharded optimizer (``zero``) the update runs on the core devices (the first
``t_min`` slots of every replica) and leaves the loss and gradient norm there. A process
whose devices all lie past ``t_min`` of their replicas (one process per GPU, a replica at
degree 7 beside replicas of degree 8) gets them through a program over a class mesh that
holds one of its devices: replica 0's slot 0, a core device, gives them to every device of
the class. The program is one ``jax.jit`` object per class mesh in the run's
``ProgramCache``, so compiling it ahead (``lower``) leaves the step nothing to compile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.program_cache import ProgramCache
from ntp_jax.sharding.mesh import DP, TP
from ntp_jax.sharding.topology import mine, processes_of

NAMES = ("loss", "grad_norm")
_ZERO = np.zeros((1, 1), np.float32)


def handoff_classes(meshes: Sequence[Mesh], core: Mesh) -> list[int]:
  """Indices of the class ``meshes`` holding a device of a process with no device of the
  ``core`` mesh (the sharded update's): the classes whose program hands the metrics on."""
  core_processes = processes_of(core)
  return [i for i, mesh in enumerate(meshes) if processes_of(mesh) - core_processes]


def cache_key(mesh: Mesh) -> tuple:
  """The ``ProgramCache`` key of the handoff program over ``mesh``."""
  return ("metrics handoff", mesh)


def _program(cache: ProgramCache, mesh: Mesh):
  return cache.program(cache_key(mesh), lambda: jax.jit(jax.shard_map(
      _from_first_device, mesh=mesh, in_specs=P(DP, TP), out_specs=P())))


def hand_off(cache: ProgramCache, mesh: Mesh, metrics: dict | None) -> dict:
  """The metrics replicated over the class ``mesh`` (``[replicas, degree]`` devices).

  Args:
    cache: the run's programs.
    mesh: a class mesh holding a device of this process; its replica 0's slot 0 is a core
      device.
    metrics: ``{"loss", "grad_norm"}``, float32 arrays holding the same value on every
      core device (``ShardedOptimizer.reduce``, ``norm``); None in a process holding no
      core device.

  Returns:
    The same names, float32 scalars replicated over ``mesh``.
  """
  first = mesh.devices[0, 0]
  sharding = NamedSharding(mesh, P(DP, TP))
  inputs = {}
  for name in NAMES:
    held = {} if metrics is None else {s.device: s.data for s in metrics[name].addressable_shards}
    # The scalar goes through the host: reshaping it on its device would compile a program
    # of its own on the way (one per device), past what was compiled ahead.
    inputs[name] = jax.make_array_from_single_device_arrays(
        mesh.devices.shape, sharding,
        [jax.device_put(np.asarray(held[d], np.float32).reshape(1, 1) if d == first else _ZERO, d)
         for d in mine(mesh)])
  return _program(cache, mesh)(inputs)


def lower(cache: ProgramCache, mesh: Mesh) -> jax.stages.Lowered:
  """``hand_off``'s program over ``mesh``, lowered for compiling ahead."""
  value = jax.ShapeDtypeStruct(mesh.devices.shape, jnp.float32,
                               sharding=NamedSharding(mesh, P(DP, TP)))
  return _program(cache, mesh).lower({name: value for name in NAMES})


def _from_first_device(x: dict[str, Any]) -> dict[str, Any]:
  """Inside a class body: each ``[1, 1]`` value from replica 0's slot 0, replicated."""
  first = (jax.lax.axis_index(DP) == 0) & (jax.lax.axis_index(TP) == 0)
  return {k: jax.lax.psum(jnp.where(first, v[0, 0], 0.0), (DP, TP)) for k, v in x.items()}
