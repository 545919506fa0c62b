"""Collectives over the ``'tp'`` axis for padded uneven blocks.

Every function here runs inside a ``jax.shard_map`` body over a mesh with a
``'tp'`` axis (see ``ntp_jax.mesh``) and takes the local padded block of the
device. Unevenness is explicit: per-slot sizes and offsets come from the
``Layout`` as static tables indexed by the device's position on the axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ntp_jax.layout import Layout
from ntp_jax.mesh import TP


def slot_position() -> jax.Array:
  """int32 scalar: this device's position on the ``'tp'`` axis (index into live slots)."""
  return jax.lax.axis_index(TP)


def local_size(layout: Layout) -> jax.Array:
  """int32 scalar: logical elements in this device's block (the rest is padding)."""
  return jnp.asarray(layout.sizes, jnp.int32)[slot_position()]


def local_offset(layout: Layout) -> jax.Array:
  """int32 scalar: logical index of this device's first element."""
  return jnp.asarray(layout.offsets, jnp.int32)[slot_position()]


def local_valid(layout: Layout) -> jax.Array:
  """bool [block]: True for entries of this device's block that hold logical elements."""
  return jnp.arange(layout.block) < local_size(layout)


def tp_sum(x: jax.Array) -> jax.Array:
  """All-reduce (sum) over the TP group: partial sums of a row-parallel product."""
  return jax.lax.psum(x, TP)


def tp_max(x: jax.Array) -> jax.Array:
  """All-reduce (max) over the TP group; no gradient flows through it."""
  return jax.lax.pmax(jax.lax.stop_gradient(x), TP)


def all_gather_uneven(x_blk: jax.Array, layout: Layout, axis: int = -1) -> jax.Array:
  """All-gather padded blocks into the logical array, on every device.

  Args:
    x_blk: local block, ``layout.block`` long on ``axis``.
    layout: the split of that axis.
    axis: the block axis.

  Returns:
    The logical array, ``layout.size`` long on ``axis`` (padding removed),
    identical on every device of the TP group.
  """
  axis = axis % x_blk.ndim
  gathered = jax.lax.all_gather(x_blk, TP, axis=axis, tiled=True)  # [..., degree*block, ...]
  return jnp.take(gathered, layout.scatter_index(), axis=axis)


def reduce_scatter_uneven(x: jax.Array, layout: Layout, axis: int = -1) -> jax.Array:
  """Sum a logical array over the TP group and keep this device's padded block.

  Args:
    x: logical array on every device, ``layout.size`` long on ``axis``
      (per-device partial sums).
    layout: the split of that axis.
    axis: the split axis.

  Returns:
    This device's block of the sum, ``layout.block`` long on ``axis``,
    zero in the padding.
  """
  axis = axis % x.ndim
  index = layout.gather_index().reshape(-1)  # [degree*block], -1 = padding
  padded = jnp.take(x, np.maximum(index, 0), axis=axis)
  mask_shape = [1] * x.ndim
  mask_shape[axis] = index.size
  padded = jnp.where((index >= 0).reshape(mask_shape), padded, jnp.zeros((), x.dtype))
  return jax.lax.psum_scatter(padded, TP, scatter_dimension=axis, tiled=True)
