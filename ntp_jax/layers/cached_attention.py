"""Attention over a key/value cache, on an ``Attention`` layer's own blocks (decoding).

Text generation runs the prompt once (prefill) and then one token per step;
each step's queries attend over the keys and values of every earlier
position, kept in a cache instead of recomputed (the KV cache of
autoregressive Transformer decoding; Pope et al., "Efficiently Scaling
Transformer Inference", arXiv:2211.05102, Sec. 2). This module reads the
parameters of ``ntp_jax.layers.attention.Attention`` as they are, padded
blocks and all, so a model decodes on any layout it trains on; the training
layer itself is not changed.

Per slot the cache holds the slot's KV groups in its block order: its own
groups (zero-padded to the largest own run), then the shared groups
(``Layout.shared_units``). Training splits the shared groups' work by
sequence position; a decoding step has one position, so here every slot
computes the shared groups for every new position (the block it holds
anyway: per slot the work of ``layout.block_units`` groups) and only slot 0
adds their output to the all-reduce, which counts each head once. Padded
groups have zero weights: zero queries, keys and values, zero output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ntp_jax.layers.attention import Attention
from ntp_jax.layers.params import local_block
from ntp_jax.layers.rope import apply_rope
from ntp_jax.sharding.collectives import enter_tp, slot_position, tp_sum


def cache_heads(attn: Attention) -> int:
  """KV heads per slot in the cache of ``attn``: its block's KV groups, own and shared."""
  return attn.wk.tp_layout.block // attn.head_dim


def cached_attention(attn: Attention, x: jax.Array, cos: jax.Array, sin: jax.Array,
                     k_cache: jax.Array, v_cache: jax.Array, offset: jax.Array
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Causal GQA of new positions over the cache; call inside a ``shard_map`` body.

  Args:
    attn: the layer (local view: this slot's blocks).
    x: ``[batch, new, d_model]`` (same on every slot): the inputs at positions
      ``offset .. offset + new - 1``.
    cos, sin: f32 ``[1, new, head_dim / 2]``, RoPE at those positions
      (``ntp_jax.layers.rope.rope_angles``).
    k_cache, v_cache: ``[batch, max_len, heads, head_dim]`` with ``heads =
      cache_heads(attn)``, this slot's keys (RoPE applied) and values of the
      positions before ``offset``; entries at ``offset`` and later are ignored.
    offset: int32 scalar, the position of ``x[:, 0]``.

  Returns:
    ``(out, k_cache, v_cache)``: ``out [batch, new, d_model]`` (replicated, in
    ``attn.dtype``), and the caches with the new positions written at
    ``offset`` (same shapes and dtypes as given). ``offset + new`` must not
    exceed ``max_len`` (not checked here: ``jax.lax.dynamic_update_slice``
    would move the write back).
  """
  # x: [b, s, d_model]; wq: [d_model, q_blk], wk, wv: [d_model, kv_blk], wo: [q_blk, d_model]
  wq, wk, wv, wo = (local_block(w).astype(attn.dtype)
                    for w in (attn.wq, attn.wk, attn.wv, attn.wo))
  x = enter_tp(x.astype(attn.dtype))
  b, s, _ = x.shape
  heads = cache_heads(attn)
  q = apply_rope((x @ wq).reshape(b, s, heads * attn.group, attn.head_dim), cos, sin)
  k = apply_rope((x @ wk).reshape(b, s, heads, attn.head_dim), cos, sin)
  v = (x @ wv).reshape(b, s, heads, attn.head_dim)
  k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), offset, axis=1)
  v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), offset, axis=1)
  positions = offset + jnp.arange(s)
  visible = jnp.arange(k_cache.shape[1])[None, :] <= positions[:, None]  # [s, max_len]
  # Query head n reads KV head n // group, as in training (jax.nn.dot_product_attention).
  attended = jax.nn.dot_product_attention(q, k_cache.astype(attn.dtype),
                                          v_cache.astype(attn.dtype), mask=visible[None, None])
  attended = attended.reshape(b, s, heads * attn.group * attn.head_dim)  # [b, s, q_blk]
  if attn.shared_units:  # shared heads: every slot holds them, slot 0's output counts
    own = jnp.arange(attended.shape[-1]) < attn.wq.tp_layout.own_size
    attended = jnp.where(own | (slot_position() == 0), attended, jnp.zeros((), attended.dtype))
  return tp_sum(attended @ wo), k_cache, v_cache
