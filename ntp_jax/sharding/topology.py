"""Which devices, meshes and arrays belong to this process.

In a multi-process job every process sees every device (``jax.devices()``)
but drives only its own (``jax.local_devices()``): it calls the programs of
meshes that hold one of them and hands over only their buffers. These
helpers answer "is it mine" in one place.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh


def devices_of(where: Mesh | np.ndarray | Iterable[jax.Device]) -> list[jax.Device]:
  """The devices of a mesh, a device grid (any shape) or an iterable of devices, in order."""
  if isinstance(where, Mesh):
    return list(where.devices.flat)
  if isinstance(where, np.ndarray):
    return list(where.flat)
  return list(where)


def is_mine(device: jax.Device) -> bool:
  """``device`` is driven by this process."""
  return device.process_index == jax.process_index()


def mine(where: Mesh | np.ndarray | Iterable[jax.Device]) -> list[jax.Device]:
  """This process's devices among ``where``'s, in ``where``'s order."""
  return [d for d in devices_of(where) if is_mine(d)]


def holds_mine(where: Mesh | np.ndarray | Iterable[jax.Device]) -> bool:
  """``where`` holds a device of this process (so its programs must be called here)."""
  return any(is_mine(d) for d in devices_of(where))


def processes_of(where: Mesh | np.ndarray | Iterable[Any]) -> set[int]:
  """The process indices of ``where``'s devices."""
  return {d.process_index for d in devices_of(where)}
