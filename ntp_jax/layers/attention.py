"""Causal grouped-query attention with heads split on KV-group boundaries.

The shard unit is one KV-head group: a KV head and the ``n_heads /
n_kv_heads`` query heads that read it (Ainslie et al., GQA,
arXiv:2305.13245). A slot holding ``k`` units computes ``k`` KV heads and
``k * group`` query heads with no communication; the output projection is
row-parallel (one all-reduce). Padded units have zero weights: their queries,
keys and values are zero, their attention output is zero and meets zero rows
of ``wo``, so they contribute nothing and receive zero gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ntp_jax.layers.linear import ColumnParallelLinear, RowParallelLinear
from ntp_jax.layers.rope import apply_rope
from ntp_jax.layout import Layout


class Attention(nnx.Module):
  """``[batch, seq, d_model] -> [batch, seq, d_model]`` causal GQA, heads split by KV group.

  Args:
    d_model: model width.
    n_heads: query heads (a multiple of ``n_kv_heads``).
    head_dim: features per head.
    layout: split of the ``n_kv_heads = layout.num_units`` KV-head groups.

  Parameters: ``wq.kernel [degree, d_model, block * group * head_dim]``,
  ``wk.kernel``, ``wv.kernel [degree, d_model, block * head_dim]``,
  ``wo.kernel [degree, block * group * head_dim, d_model]``.

  Raises:
    ValueError: ``n_heads`` not a multiple of the number of KV heads.
  """

  def __init__(self, d_model: int, n_heads: int, head_dim: int, layout: Layout, *,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    n_kv_heads = layout.num_units
    if n_kv_heads < 1 or n_heads % n_kv_heads:
      raise ValueError(
          f"model.n_heads: {n_heads} query heads are not a multiple of "
          f"{n_kv_heads} KV heads")
    self.group = n_heads // n_kv_heads
    self.head_dim = head_dim
    self.kv_block = layout.block_units
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    q_layout = layout.with_unit_size(self.group * head_dim)
    kv_layout = layout.with_unit_size(head_dim)
    self.wq = ColumnParallelLinear(d_model, q_layout, **kw)
    self.wk = ColumnParallelLinear(d_model, kv_layout, **kw)
    self.wv = ColumnParallelLinear(d_model, kv_layout, **kw)
    self.wo = RowParallelLinear(q_layout, d_model, **kw)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    b, s, _ = x.shape
    # Local blocks: q [b, s, kv_block * group, head_dim]; k, v [b, s, kv_block, head_dim].
    q = self.wq(x).reshape(b, s, self.kv_block * self.group, self.head_dim)
    k = self.wk(x).reshape(b, s, self.kv_block, self.head_dim)
    v = self.wv(x).reshape(b, s, self.kv_block, self.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # Query head n reads KV head n // group, the grouping dot_product_attention uses.
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return self.wo(out.reshape(b, s, self.kv_block * self.group * self.head_dim))
