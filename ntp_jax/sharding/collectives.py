"""Collectives over the ``'tp'`` axis for padded uneven blocks.

Every function here runs inside a ``jax.shard_map`` body over a mesh with a
``'tp'`` axis (see ``ntp_jax.sharding.mesh``) and takes the local padded block of the
device. Unevenness is explicit: per-slot sizes and offsets come from the
``Layout`` as static tables indexed by the device's position on the axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ntp_jax.sharding.layout import Layout
from ntp_jax.sharding.mesh import TP


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


def enter_tp(x: jax.Array) -> jax.Array:
  """Mark a replicated activation as the input of a tensor-parallel region (identity).

  Every product with a split weight that reads ``x`` contributes a partial
  cotangent on each device. Entering the region once per block input makes
  those partials add up locally, so the backward pass runs one all-reduce of
  their sum (the transpose of this cast) instead of one per product: q, k and
  v share one, gate and up share one (Megatron-LM's ``f`` operator,
  arXiv:1909.08053 Sec. 3, reached through ``jax.lax.pcast``). A value
  already varying over ``'tp'`` is returned unchanged.
  """
  if TP in _varying_axes(x):
    return x
  if hasattr(jax.lax, "pcast"):
    return jax.lax.pcast(x, TP, to="varying")
  return jax.lax.pvary(x, TP)  # the name before jax.lax.pcast


def _varying_axes(x: jax.Array) -> frozenset:
  """The mesh axes ``x`` varies over inside ``shard_map`` (its type's, across JAX versions)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def sum_if_many(x: jax.Array, axis: str, size: int) -> jax.Array:
  """``psum`` over ``axis`` of ``size`` devices; ``x`` itself when there is one.

  An all-reduce over a group of one moves nothing but still runs as a copy and
  a synchronisation point, so callers that know the axis size skip it.
  """
  return jax.lax.psum(x, axis) if size > 1 else x


def tp_max(x: jax.Array) -> jax.Array:
  """All-reduce (max) over the TP group; no gradient flows through it."""
  return jax.lax.pmax(jax.lax.stop_gradient(x), TP)


def copy_shared_from_last(x_blk: jax.Array, layout: Layout, axis: int) -> jax.Array:
  """Give every slot the last slot's copy of the shared units (``Layout.shared_units``).

  Args:
    x_blk: local block, ``layout.block`` long on ``axis``, whose shared region
      holds data on the last slot only (as after a move into ``owner_layout``).
    layout: the block's layout. axis: the block axis.

  Returns:
    ``x_blk`` with the shared region equal on every slot (a masked all-reduce);
    unchanged when the layout has no shared units.
  """
  if not layout.shared_units:
    return x_blk
  start = layout.own_size
  last = slot_position() == layout.degree - 1
  shared = jax.lax.slice_in_dim(x_blk, start, layout.block, axis=axis)
  shared = tp_sum(jnp.where(last, shared, jnp.zeros((), shared.dtype)))
  return jnp.concatenate([jax.lax.slice_in_dim(x_blk, 0, start, axis=axis), shared], axis=axis)


def all_gather_uneven(x_blk: jax.Array, layout: Layout, axis: int = -1) -> jax.Array:
  """All-gather padded blocks into the logical array, on every device.

  Args:
    x_blk: local block, ``layout.block`` long on ``axis``.
    layout: the split of that axis.
    axis: the block axis.

  Returns:
    The logical array, ``layout.size`` long on ``axis`` (padding removed),
    identical on every device of the TP group (JAX types it as varying over
    ``'tp'``: returning it with ``out_specs=P()`` needs ``check_vma=False``).
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


def transfer_schedule(src: Layout, dst: Layout) -> list[dict[str, np.ndarray | int]]:
  """Static ppermute schedule that moves a split dimension from layout ``src`` to ``dst``.

  Both layouts are contiguous runs over the same ``degree`` positions and the
  same logical size. Source position ``i`` sends to ``i + shift`` the overlap
  of its run with the destination's run; for each shift there is one
  ``ppermute`` of a piece of ``length`` elements (the longest overlap).

  Returns:
    One dict per shift with ``shift``, ``length``, and int32 tables indexed by
    position: ``send_start``/``send_len`` (in the source block),
    ``recv_start``/``recv_len`` (in the destination block).
  """
  if src.size != dst.size or src.degree != dst.degree:
    raise ValueError(f"reshard: layouts differ in size or degree ({src} -> {dst})")
  n = src.degree
  by_shift: dict[int, dict[str, np.ndarray]] = {}
  for i, (a, la) in enumerate(zip(src.offsets, src.sizes)):
    for j, (c, lc) in enumerate(zip(dst.offsets, dst.sizes)):
      lo, hi = max(a, c), min(a + la, c + lc)
      if hi <= lo:
        continue
      entry = by_shift.setdefault(j - i, {k: np.zeros(n, np.int32) for k in (
          "send_start", "send_len", "recv_start", "recv_len")})
      entry["send_start"][i], entry["send_len"][i] = lo - a, hi - lo
      entry["recv_start"][j], entry["recv_len"][j] = lo - c, hi - lo
  return [dict(shift=shift, length=int(t["send_len"].max()), **t)
          for shift, t in sorted(by_shift.items(), key=lambda kv: (kv[0] != 0, abs(kv[0])))]


def reshard_uneven(x_blk: jax.Array, src: Layout, dst: Layout, axis: int) -> jax.Array:
  """Move this device's block from layout ``src`` to layout ``dst`` inside the TP group.

  Only elements that change device move (one ``ppermute`` per distinct
  shift of ``transfer_schedule``); nothing is gathered whole.

  Args:
    x_blk: local block, ``src.block`` long on ``axis`` (zero in padding).
    src, dst: contiguous layouts of one dimension over the same positions.
    axis: the block axis of ``x_blk``.

  Returns:
    The local block in ``dst``: ``dst.block`` long on ``axis``, zero in padding.
  """
  return _reshard_uneven(x_blk, src, dst, axis % x_blk.ndim)


# A nested jit (XLA inlines it): traced once per block type, layouts and axis, then reused
# by every leaf, program and run of the process that moves such a block alike.
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _reshard_uneven(x_blk: jax.Array, src: Layout, dst: Layout, axis: int) -> jax.Array:
  schedule = transfer_schedule(src, dst)
  longest = max((t["length"] for t in schedule), default=0)
  pad = [(0, 0)] * x_blk.ndim
  pad[axis] = (0, longest)
  source = jnp.pad(x_blk, pad)
  out_shape = list(x_blk.shape)
  out_shape[axis] = dst.block + longest
  out = jnp.zeros(out_shape, x_blk.dtype)
  pos = slot_position()
  for t in schedule:
    length = t["length"]
    keep_shape = [1] * x_blk.ndim
    keep_shape[axis] = length
    steps = jnp.arange(length).reshape(keep_shape)
    piece = jax.lax.dynamic_slice_in_dim(source, jnp.asarray(t["send_start"])[pos], length, axis)
    piece = jnp.where(steps < jnp.asarray(t["send_len"])[pos], piece, 0)
    if t["shift"]:
      pairs = [(i, i + t["shift"]) for i in range(src.degree) if t["send_len"][i] > 0]
      piece = jax.lax.ppermute(piece, TP, pairs)
    piece = jnp.where(steps < jnp.asarray(t["recv_len"])[pos], piece, 0)
    start = jnp.asarray(t["recv_start"])[pos]
    current = jax.lax.dynamic_slice_in_dim(out, start, length, axis)
    out = jax.lax.dynamic_update_slice_in_dim(out, current + piece, start, axis)
  return jax.lax.slice_in_dim(out, 0, dst.block, axis=axis)
