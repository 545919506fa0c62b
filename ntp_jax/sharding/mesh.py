"""Device meshes for one replica class: axes ``('dp', 'tp')``.

A replica class is a set of DP replicas that share one layout; its program
runs over a mesh of ``replicas x degree`` devices, where row ``r`` holds the
live slots of replica ``r`` in slot order. The ``'tp'`` axis carries the
padded per-slot blocks; the ``'dp'`` axis carries the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

DP = "dp"  # data-parallel replicas of one class
TP = "tp"  # live slots of a TP group (one padded block per device)


def device_for_slot(replica: int, slot: int, tp: int, devices: Sequence[jax.Device]) -> jax.Device:
  """The device that holds ``slot`` of ``replica``: slot-major within a replica.

  Raises:
    ValueError: the job needs more devices than are present.
  """
  index = replica * tp + slot
  if index >= len(devices):
    raise ValueError(
        f"mesh: replica {replica} slot {slot} needs device {index}, but only "
        f"{len(devices)} devices are present")
  return devices[index]


def class_mesh(replicas: Sequence[int], live_slots: Sequence[Sequence[int]], tp: int,
               devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Mesh ``('dp', 'tp')``: row ``i`` holds the live slots of ``replicas[i]``, in slot order.

  Args:
    replicas: DP replica indices in the class.
    live_slots: each replica's live slot indices (all of one length: the
      class's TP degree); replicas may have lost different slots.
    tp: nominal slots per TP group (devices per replica, failed ones included).
    devices: the job's devices (default ``jax.devices()``); a failed slot's
      device is left out of the mesh and stays idle.
  """
  devices = list(jax.devices() if devices is None else devices)
  if len({len(slots) for slots in live_slots}) != 1 or len(live_slots) != len(replicas):
    raise ValueError(f"mesh: replicas {list(replicas)} need one live-slot list each, "
                     f"all of one length; got {list(live_slots)}")
  grid = [[device_for_slot(r, s, tp, devices) for s in slots]
          for r, slots in zip(replicas, live_slots)]
  return Mesh(np.array(grid, dtype=object), (DP, TP))
