"""Column- and row-parallel linear layers over padded uneven blocks.

Column-parallel: ``y_blk = x @ W[:, slot's columns]``, the output stays split
(padded columns are zero). Row-parallel: ``y = sum_slots x_blk @ W[slot's
rows, :]``, an all-reduce over ``'tp'``. Source: Shoeybi et al., Megatron-LM
(arXiv:1909.08053) Sec. 3, with per-slot sizes from a ``Layout``.
Both run inside a ``shard_map`` body (local view).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ntp_jax.layers.params import Initializer, local_block, tp_param
from ntp_jax.sharding.collectives import enter_tp, tp_sum
from ntp_jax.sharding.layout import Layout

default_kernel_init = nnx.initializers.normal(stddev=0.02)


class ColumnParallelLinear(nnx.Module):
  """``[..., d_in] -> [..., block]``: this slot's output columns of ``x @ W``.

  Args:
    d_in: input features (replicated input).
    layout: split of the output features (``layout.size`` columns).
    dtype: compute dtype. param_dtype: storage dtype.
    kernel_init: initializer of the logical ``[d_in, layout.size]`` kernel.

  Parameters: ``kernel`` f32 ``[degree, d_in, block]``.
  """

  def __init__(self, d_in: int, layout: Layout, *, dtype=jnp.float32,
               param_dtype=jnp.float32, kernel_init: Initializer = default_kernel_init,
               rngs: nnx.Rngs):
    self.layout = layout
    self.dtype = dtype
    self.kernel = tp_param(rngs, kernel_init, (d_in, layout.size), layout, 1, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    # x: [..., d_in] (same on every slot); kernel: [d_in, block]
    w = local_block(self.kernel).astype(self.dtype)
    return jnp.einsum("...d,df->...f", enter_tp(x.astype(self.dtype)), w)


class RowParallelLinear(nnx.Module):
  """``[..., block] -> [..., d_out]``: all-reduce of the slots' partial products.

  Args:
    layout: split of the input features (``layout.size`` rows).
    d_out: output features (replicated output).

  Parameters: ``kernel`` f32 ``[degree, block, d_out]``.
  """

  def __init__(self, layout: Layout, d_out: int, *, dtype=jnp.float32,
               param_dtype=jnp.float32, kernel_init: Initializer = default_kernel_init,
               rngs: nnx.Rngs):
    self.layout = layout
    self.dtype = dtype
    self.kernel = tp_param(rngs, kernel_init, (layout.size, d_out), layout, 0, param_dtype)

  def __call__(self, x_blk: jax.Array) -> jax.Array:
    # x_blk: [..., block] (zero in padding); kernel: [block, d_out]
    w = local_block(self.kernel).astype(self.dtype)
    return tp_sum(jnp.einsum("...f,fd->...d", x_blk.astype(self.dtype), w))
