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


def class_mesh(replicas: Sequence[int], live_slots: Sequence[int], tp: int,
               devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Mesh ``('dp', 'tp')`` over the live slots of ``replicas`` (all with ``live_slots``).

  Args:
    replicas: DP replica indices in the class.
    live_slots: live slot indices shared by those replicas.
    tp: nominal slots per TP group (devices per replica, failed ones included).
    devices: the job's devices (default ``jax.devices()``); a failed slot's
      device is left out of the mesh and stays idle.
  """
  devices = list(jax.devices() if devices is None else devices)
  grid = [[device_for_slot(r, s, tp, devices) for s in live_slots] for r in replicas]
  return Mesh(np.array(grid, dtype=object), (DP, TP))
