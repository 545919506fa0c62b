"""Vocabulary-parallel token embedding.

Each slot holds a contiguous run of vocabulary rows; a token's vector comes
from the one slot that holds its row, and an all-reduce over ``'tp'`` brings
it to every slot. Padded rows are never looked up, so they get no gradient.
``attend`` reuses the table as a tied output head (Press & Wolf,
arXiv:1608.05859): each slot's product with its rows is its vocabulary block
of the logits, split like a column-parallel head over the same layout.
Source: Megatron-LM (arXiv:1909.08053) Sec. 3, rows split by a ``Layout``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ntp_jax.layers.params import Initializer, local_block, tp_param
from ntp_jax.sharding.collectives import local_offset, local_size, tp_sum
from ntp_jax.sharding.layout import Layout


class VocabParallelEmbed(nnx.Module):
  """``int [...] -> [..., d_model]`` lookup with the table split by vocabulary rows.

  Args:
    layout: split of the vocabulary (``layout.size`` rows).
    d_model: embedding width.

  Parameters: ``embedding`` f32 ``[degree, block, d_model]``.
  """

  def __init__(self, layout: Layout, d_model: int, *, dtype=jnp.float32,
               param_dtype=jnp.float32,
               embedding_init: Initializer = nnx.initializers.normal(stddev=0.02),
               rngs: nnx.Rngs):
    self.layout = layout
    self.dtype = dtype
    self.embedding = tp_param(rngs, embedding_init, (layout.size, d_model), layout, 0,
                              param_dtype)

  def __call__(self, ids: jax.Array) -> jax.Array:
    # ids: int [...] (same on every slot); table: [block, d_model]
    table = local_block(self.embedding).astype(self.dtype)
    local_ids = ids - local_offset(self.layout)
    mine = (local_ids >= 0) & (local_ids < local_size(self.layout))
    rows = jnp.take(table, jnp.where(mine, local_ids, 0), axis=0)
    return tp_sum(jnp.where(mine[..., None], rows, jnp.zeros((), self.dtype)))

  def attend(self, x: jax.Array) -> jax.Array:
    """``[..., d_model] -> [..., block]``: this slot's logits ``x @ table_blk.T`` (tied head).

    Padded rows are zero, so their logits are zero; the vocabulary-parallel
    cross-entropy masks them, so they get no gradient from here either.
    """
    # x: [..., d_model] (same on every slot); table: [block, d_model]
    table = local_block(self.embedding).astype(self.dtype)
    return jnp.einsum("...d,vd->...v", x.astype(self.dtype), table)
