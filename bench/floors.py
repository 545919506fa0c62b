"""The floors a live move is measured against: the least bytes a failure needs moved, and a
plain copy of a number of bytes between two devices (``bench/move_floor.py``,
``bench/recovery.py``). Import after JAX's devices are set up (``common.simulate_cpu_devices``).
"""

import time
import types

import jax
import numpy as np

from ntp_jax.parallel.programs import plan_shapes
from ntp_jax.state.placement import leaves_of


def held_elements(leaf, slot: int) -> set[int]:
  """Logical indices along the split axis that live slot ``slot`` holds (its run and the
  shared units); one token standing for the whole leaf when it is not split."""
  if leaf.layout is None:
    return {-2}
  index = leaf.layout.gather_index()[slot]
  return set(index[index >= 0].tolist())


def minimum_bytes(old_programs, new_programs) -> int:
  """Bytes the new plan's devices hold that they did not hold on the old plan: for every leaf
  (parameters and optimizer state) and device, the logical elements it holds now and did not
  hold before (``Layout.gather_index``), in the class dtype. Programs (or ``plan_programs``)
  need ``mesh``, ``params`` and ``opt_state``, arrays or shapes."""
  held: dict = {}  # (device, path) -> logical indices held on the old plan
  for program in old_programs:
    leaves, _, _ = leaves_of({"params": program.params, "opt_state": program.opt_state})
    for row in program.mesh.devices:
      for slot, device in enumerate(row):
        for leaf in leaves:
          held[(device, leaf.path)] = held_elements(leaf, slot)
  total = 0
  for program in new_programs:
    leaves, _, _ = leaves_of({"params": program.params, "opt_state": program.opt_state})
    for row in program.mesh.devices:
      for slot, device in enumerate(row):
        for leaf in leaves:
          missing = len(held_elements(leaf, slot) - held.get((device, leaf.path), set()))
          if leaf.layout is None:
            total += leaf.nbytes * missing
          else:
            total += missing * (leaf.nbytes // leaf.shape[leaf.axis])
  return total


def plan_programs(plan, make_model, optimizer, devices) -> list:
  """Each class of ``plan`` as its mesh and abstract state (what ``minimum_bytes`` reads)."""
  shapes = plan_shapes(plan, make_model, optimizer, devices)
  return [types.SimpleNamespace(mesh=mesh, params=state["params"], opt_state=state["opt_state"])
          for mesh, (_, state) in zip(shapes.meshes, shapes.targets)]


def plain_copy_seconds(nbytes: int, source, target) -> float:
  """The fastest of three ``jax.device_put``s of one ``nbytes`` buffer from ``source`` to
  ``target``."""
  buffer = jax.device_put(np.ones(max(1, nbytes // 4), np.float32), source)
  best = float("inf")
  for _ in range(3):
    start = time.perf_counter()
    jax.block_until_ready(jax.device_put(buffer, target))
    best = min(best, time.perf_counter() - start)
  return best
