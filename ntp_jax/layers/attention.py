"""Causal grouped-query attention with heads split on KV-group boundaries.

The shard unit is one KV-head group: a KV head and the ``n_heads /
n_kv_heads`` query heads that read it (Ainslie et al., GQA,
arXiv:2305.13245). A slot holding ``k`` units computes ``k`` KV heads and
``k * group`` query heads with no communication; the output projection is
row-parallel (one all-reduce), and the input enters the TP region once
(one all-reduce of its gradient). Padded units have zero weights: their queries,
keys and values are zero, their attention output is zero and meets zero rows
of ``wo``, so they contribute nothing and receive zero gradient.

When the layout has shared units (``Layout.shared_units``: the KV groups
left over after an even split, e.g. 8 groups on 7 slots = 1 each + 1
shared), every slot holds their weights and computes them for its run of
sequence positions only (keys and values all-gathered), so every slot does
the same work and none computes a padded group. Their weight gradients are
per-slot partial sums, added over the TP group by
``ntp_jax.layers.params.sum_shared_grads``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ntp_jax.layers.linear import default_kernel_init
from ntp_jax.layers.params import local_block, tp_param
from ntp_jax.layers.rope import apply_rope
from ntp_jax.sharding.collectives import enter_tp, slot_position, tp_sum
from ntp_jax.sharding.layout import Layout
from ntp_jax.sharding.mesh import TP


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
    # One entry for q, k and v (and the shared groups): one all-reduce of their input gradient.
    x = enter_tp(x.astype(self.dtype))
    out = self._heads(x, cos, sin, wq[:, :q_own], wk[:, :kv_own], wv[:, :kv_own], wo[:q_own],
                      self.own_units)
    if self.shared_units:
      partial, start = self._shared_heads(x, cos, sin, wq[:, q_own:], wk[:, kv_own:],
                                          wv[:, kv_own:], wo[q_own:])
      # Placed into zeros and added (not updated into ``out`` in place): the transpose is
      # then a slice of the output gradient, with no full-size copy of it.
      out = out + jax.lax.dynamic_update_slice_in_dim(jnp.zeros_like(out), partial, start, axis=1)
    return tp_sum(out)

  def _project(self, x, cos, sin, wq, wk, wv, units):
    """q ``[b, s, units * group, head_dim]``, k, v ``[b, s, units, head_dim]``, RoPE applied."""
    b, s, _ = x.shape
    q = (x @ wq).reshape(b, s, units * self.group, self.head_dim)
    k = (x @ wk).reshape(b, s, units, self.head_dim)
    v = (x @ wv).reshape(b, s, units, self.head_dim)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

  def _heads(self, x, cos, sin, wq, wk, wv, wo, units):
    """Partial output ``[b, s, d_model]`` of ``units`` KV groups on rows ``x``."""
    b, s, _ = x.shape
    q, k, v = self._project(x, cos, sin, wq, wk, wv, units)
    # Query head n reads KV head n // group, the grouping dot_product_attention uses.
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return attended.reshape(b, s, units * self.group * self.head_dim) @ wo

  def _shared_heads(self, x, cos, sin, wq, wk, wv, wo):
    """Shared KV groups on this slot's run of positions, every row: ``(partial, start)``.

    ``partial [b, chunk, d_model]`` is their output on positions ``start ..
    start + chunk`` (zero where the run repeats a neighbour's positions).

    The sequence is cut into runs of ``chunk = ceil(seq / degree)`` positions,
    one per slot. A slot projects q, k and v and applies ``wo`` for its run
    only, and its queries attend over the keys and values of every position,
    all-gathered over the TP group: every slot does ``1 / degree`` of the
    work, up to rounding the run length up, whatever the batch. Runs that
    would pass the end start earlier instead (one shape on every slot); the
    positions such a run repeats from its neighbour are masked out of its
    output, and the gathered keys take each position from the slot that owns it.
    """
    b, s, _ = x.shape
    chunk = -(-s // self.degree)
    starts = [min(i * chunk, s - chunk) for i in range(self.degree)]
    slot = slot_position()
    start = jnp.asarray(starts, jnp.int32)[slot]
    run = lambda a: jax.lax.dynamic_slice_in_dim(a, start, chunk, axis=1)  # noqa: E731
    q, k, v = self._project(run(x), run(cos), run(sin), wq, wk, wv, self.shared_units)
    k_all, v_all = (self._owned_positions(jax.lax.all_gather(a, TP, axis=1, tiled=True),
                                          starts, chunk, s) for a in (k, v))
    positions = start + jnp.arange(chunk)
    causal = jnp.arange(s)[None, :] <= positions[:, None]  # [chunk, s]
    attended = jax.nn.dot_product_attention(q, k_all, v_all, mask=causal[None, None])
    partial = attended.reshape(b, chunk, -1) @ wo  # [b, chunk, d_model]
    owned = positions >= slot * chunk  # a repeated position is its neighbour's
    return jnp.where(owned[None, :, None], partial, jnp.zeros((), partial.dtype)), start

  @staticmethod
  def _owned_positions(gathered, starts, chunk, s):
    """``[b, degree * chunk, ...]`` runs -> ``[b, s, ...]``, each position from its owner."""
    pieces = []
    for i, start in enumerate(starts):
      lo, hi = i * chunk, min((i + 1) * chunk, s)
      if hi > lo:
        offset = i * chunk + lo - start
        pieces.append(jax.lax.slice_in_dim(gathered, offset, offset + hi - lo, axis=1))
    return jnp.concatenate(pieces, axis=1)
