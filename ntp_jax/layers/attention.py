"""Causal grouped-query attention with heads split on KV-group boundaries.

The shard unit is one KV-head group: a KV head and the ``n_heads /
n_kv_heads`` query heads that read it (Ainslie et al., GQA,
arXiv:2305.13245). A slot holding ``k`` units computes ``k`` KV heads and
``k * group`` query heads with no communication; the output projection is
row-parallel (one all-reduce). Padded units have zero weights: their queries,
keys and values are zero, their attention output is zero and meets zero rows
of ``wo``, so they contribute nothing and receive zero gradient.

When the layout has shared units (``Layout.shared_units``: the KV groups
left over after an even split, e.g. 8 groups on 3 slots = 2 each + 2
shared), every slot holds their weights and computes them for its slice of
the batch rows only, so every slot does the same work and none computes a
padded group. Their weight gradients are per-slot partial sums, added over
the TP group by ``ntp_jax.layers.params.sum_shared_grads``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ntp_jax.layers.linear import default_kernel_init
from ntp_jax.layers.params import local_block, tp_param
from ntp_jax.layers.rope import apply_rope
from ntp_jax.sharding.collectives import slot_position, tp_sum
from ntp_jax.sharding.layout import Layout


class Attention(nnx.Module):
  """``[batch, seq, d_model] -> [batch, seq, d_model]`` causal GQA, heads split by KV group.

  Args:
    d_model: model width.
    n_heads: query heads (a multiple of ``n_kv_heads``).
    head_dim: features per head.
    layout: split of the ``n_kv_heads = layout.num_units`` KV-head groups.
    dtype: compute dtype. param_dtype: storage dtype.

  Parameters (``TPParam``, drawn in this order from ``rngs.params``, each
  logical kernel from ``ntp_jax.layers.linear.default_kernel_init``):
  ``wq [degree, d_model, block * group * head_dim]`` and ``wk``, ``wv
  [degree, d_model, block * head_dim]`` split on their columns (logically
  ``[d_model, n_heads * head_dim]``, ``[d_model, n_kv_heads * head_dim]``);
  ``wo [degree, block * group * head_dim, d_model]`` split on its rows.
  ``block`` is ``layout.block`` KV groups; the layouts of the parameters are
  ``layout`` measured in ``group * head_dim`` (``wq``, ``wo``) or
  ``head_dim`` (``wk``, ``wv``) elements per unit.

  Raises:
    ValueError: ``n_heads`` not a multiple of the number of KV heads.
  """

  def __init__(self, d_model: int, n_heads: int, head_dim: int, layout: Layout, *,
               dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
    n_kv_heads = layout.num_units
    if n_kv_heads < 1 or n_heads % n_kv_heads:
      raise ValueError(
          f"Attention: n_heads {n_heads} is not a multiple of the layout's "
          f"{n_kv_heads} KV heads")
    self.group = n_heads // n_kv_heads
    self.head_dim = head_dim
    self.dtype = dtype
    self.degree = layout.degree
    self.own_units = layout.own_block_units
    self.shared_units = layout.shared_units
    q_layout = layout.with_unit_size(self.group * head_dim)
    kv_layout = layout.with_unit_size(head_dim)
    init = default_kernel_init
    self.wq = tp_param(rngs, init, (d_model, q_layout.size), q_layout, 1, param_dtype)
    self.wk = tp_param(rngs, init, (d_model, kv_layout.size), kv_layout, 1, param_dtype)
    self.wv = tp_param(rngs, init, (d_model, kv_layout.size), kv_layout, 1, param_dtype)
    self.wo = tp_param(rngs, init, (q_layout.size, d_model), q_layout, 0, param_dtype)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    # x: [b, s, d_model] (same on every slot); wq: [d_model, q_blk], wk, wv:
    # [d_model, kv_blk], wo: [q_blk, d_model] (q_blk = block * group * head_dim).
    wq, wk, wv, wo = (local_block(w).astype(self.dtype)
                      for w in (self.wq, self.wk, self.wv, self.wo))
    # Own KV groups first, then the shared ones (Layout.own_size, per parameter).
    q_own, kv_own = self.wq.tp_layout.own_size, self.wk.tp_layout.own_size
    x = x.astype(self.dtype)
    out = self._heads(x, cos, sin, wq[:, :q_own], wk[:, :kv_own], wv[:, :kv_own], wo[:q_own],
                      self.own_units)
    if self.shared_units:
      out = out + self._shared_heads(x, cos, sin, wq[:, q_own:], wk[:, kv_own:], wv[:, kv_own:],
                                     wo[q_own:])
    return tp_sum(out)

  def _heads(self, x, cos, sin, wq, wk, wv, wo, units):
    """Partial output ``[b, s, d_model]`` of ``units`` KV groups on rows ``x``."""
    b, s, _ = x.shape
    # q [b, s, units * group, head_dim]; k, v [b, s, units, head_dim].
    q = (x @ wq).reshape(b, s, units * self.group, self.head_dim)
    k = (x @ wk).reshape(b, s, units, self.head_dim)
    v = (x @ wv).reshape(b, s, units, self.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # Query head n reads KV head n // group, the grouping dot_product_attention uses.
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return attended.reshape(b, s, units * self.group * self.head_dim) @ wo

  def _shared_heads(self, x, cos, sin, wq, wk, wv, wo):
    """Shared KV groups on this slot's slice of the rows; zeros on the other rows."""
    b = x.shape[0]
    rows = -(-b // self.degree)  # ceil: the last slots may get zero rows
    padded = jnp.pad(x, ((0, rows * self.degree - b), (0, 0), (0, 0)))
    start = slot_position() * rows
    mine = jax.lax.dynamic_slice_in_dim(padded, start, rows, axis=0)
    partial = self._heads(mine, cos, sin, wq, wk, wv, wo, self.shared_units)
    placed = jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(padded[..., :partial.shape[-1]]),
                                                 partial, start, axis=0)
    return placed[:b]
