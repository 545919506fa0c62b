"""SwiGLU feed-forward block with uneven column split.

``down(silu(gate(x)) * up(x))`` (Shazeer, arXiv:2002.05202): ``gate`` and
``up`` are column-parallel, ``down`` is row-parallel, all split by one MLP
layout whose unit is ``ffn_granularity`` columns. Padded columns give
``silu(0) * 0 = 0`` and meet zero rows of ``down``: no contribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ntp_jax.layers.linear import ColumnParallelLinear, RowParallelLinear
from ntp_jax.layers.params import local_block
from ntp_jax.sharding.collectives import enter_tp
from ntp_jax.sharding.layout import Layout


class SwiGLU(nnx.Module):
  """``[..., d_model] -> [..., d_model]`` (replicated in and out).

  Args:
    d_model: model width.
    layout: split of the hidden width ``d_ff = layout.size``.

  Parameters: ``gate.kernel``, ``up.kernel`` ``[degree, d_model, block]``;
  ``down.kernel`` ``[degree, block, d_model]``.
  """

  def __init__(self, d_model: int, layout: Layout, *, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    self.dtype = dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate = ColumnParallelLinear(d_model, layout, **kw)
    self.up = ColumnParallelLinear(d_model, layout, **kw)
    self.down = RowParallelLinear(layout, d_model, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    local_block(self.gate.kernel)  # outside shard_map this raises the clear error first
    # One entry for gate and up: one all-reduce of their summed input gradient.
    x = enter_tp(x.astype(self.dtype))
    h_blk = jax.nn.silu(self.gate(x)) * self.up(x)  # [..., block]
    return self.down(h_blk)
