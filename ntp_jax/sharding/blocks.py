"""Logical arrays <-> padded per-slot blocks.

A dimension split by a ``Layout`` is stored with a leading slot axis: a
logical ``[d_model, d_ff]`` kernel split on its last axis becomes
``[degree, d_model, block]`` where slot ``i`` holds its run of columns
followed by zeros up to ``block`` (the largest slot's size). JAX shards only
dimensions the mesh axis divides (``IndivisibleError``), so unevenness is
made explicit this way and the leading axis is sharded over the mesh's
``'tp'`` axis, one block per device.

Both directions are exact (gather / scatter with static indices), work under
``jit``, ``eval_shape`` and ``grad``, and padding is always zero.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ntp_jax.sharding.layout import Layout


def _check_axis(shape: tuple[int, ...], axis: int, length: int, what: str) -> int:
  axis = axis % len(shape)
  if shape[axis] != length:
    raise ValueError(f"{what}: axis {axis} has length {shape[axis]}, layout expects {length}")
  return axis


def to_blocks(x: jnp.ndarray, layout: Layout, axis: int) -> jnp.ndarray:
  """Logical array -> padded blocks with a leading slot axis.

  Args:
    x: array whose ``axis`` has length ``layout.size``.
    layout: the split of that axis.
    axis: the split axis of ``x``.

  Returns:
    ``[layout.degree, *x.shape]`` with ``x.shape[axis]`` replaced by
    ``layout.block``; padded entries are zero. Same dtype as ``x``.

  Raises:
    ValueError: ``x.shape[axis] != layout.size``.
  """
  axis = _check_axis(x.shape, axis, layout.size, "to_blocks")
  index = layout.gather_index()  # [degree, block], -1 = padding
  taken = jnp.take(x, np.maximum(index, 0).reshape(-1), axis=axis)
  new_shape = x.shape[:axis] + (layout.degree, layout.block) + x.shape[axis + 1:]
  taken = taken.reshape(new_shape)
  mask_shape = [1] * len(new_shape)
  mask_shape[axis], mask_shape[axis + 1] = layout.degree, layout.block
  taken = jnp.where((index >= 0).reshape(mask_shape), taken, jnp.zeros((), x.dtype))
  return jnp.moveaxis(taken, axis, 0)


def from_blocks(blocks: jnp.ndarray, layout: Layout, axis: int) -> jnp.ndarray:
  """Padded blocks -> logical array; inverse of ``to_blocks`` (padding dropped).

  Args:
    blocks: ``[layout.degree, ...]`` with the block axis at ``axis`` of the
      logical array (so at ``axis + 1`` of ``blocks`` for non-negative ``axis``).
    layout: the split.
    axis: the split axis in logical coordinates.

  Returns:
    The logical array, ``blocks.shape[1:]`` with the block axis of length
    ``layout.size``.

  Raises:
    ValueError: leading axis is not ``layout.degree`` or the block axis is
      not ``layout.block``.
  """
  if blocks.shape[0] != layout.degree:
    raise ValueError(
        f"from_blocks: leading slot axis has length {blocks.shape[0]}, layout has "
        f"{layout.degree} live slots")
  logical_rank = blocks.ndim - 1
  axis = axis % logical_rank
  _check_axis(blocks.shape[1:], axis, layout.block, "from_blocks")
  moved = jnp.moveaxis(blocks, 0, axis)  # [..., degree, block, ...]
  flat = moved.reshape(moved.shape[:axis] + (layout.degree * layout.block,)
                       + moved.shape[axis + 2:])
  return jnp.take(flat, layout.scatter_index(), axis=axis)


def pad_mask(layout: Layout) -> np.ndarray:
  """bool [degree, block]: True where a block entry holds a logical element."""
  return layout.gather_index() >= 0
