"""Vocabulary-parallel softmax cross-entropy.

The logits stay split by vocabulary: each slot holds ``[..., block]`` and only
three scalars per token cross the TP group in two all-reduces (the max;
the sum of exponentials with the label's logit), so no device ever holds the full
``[..., vocab]`` logits. Padded vocabulary entries are masked out of the
max and the sum, so they receive no probability mass and no gradient.
Source: Megatron-LM (arXiv:1909.08053) Sec. 3, "parallel cross-entropy".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ntp_jax.sharding.collectives import local_offset, local_size, local_valid, tp_max, tp_sum
from ntp_jax.sharding.layout import Layout


def vocab_parallel_cross_entropy(logits_blk: jax.Array, labels: jax.Array,
                                 layout: Layout) -> jax.Array:
  """Per-token ``-log softmax(logits)[label]`` from vocabulary-split logits.

  Call inside a ``shard_map`` body over a mesh with a ``'tp'`` axis.

  Args:
    logits_blk: this slot's logits, ``[..., layout.block]`` (any float dtype;
      computed in float32).
    labels: int ``[...]``, the target token ids in ``[0, layout.size)``, same
      on every slot.
    layout: the vocabulary split.

  Returns:
    f32 ``[...]``: the loss per token, the same on every slot.
  """
  logits = logits_blk.astype(jnp.float32)
  valid = local_valid(layout)  # [block]
  logits = jnp.where(valid, logits, -jnp.inf)
  # The max only stabilises the exponent; it cancels exactly in the loss.
  local_max = jnp.max(logits, axis=-1)
  shift = tp_max(jnp.where(jnp.isfinite(local_max), local_max, jnp.finfo(jnp.float32).min))
  local_sum_exp = jnp.sum(jnp.exp(logits - shift[..., None]), axis=-1)
  local_label = labels - local_offset(layout)
  mine = (local_label >= 0) & (local_label < local_size(layout))
  picked = jnp.take_along_axis(
      logits, jnp.clip(local_label, 0, layout.block - 1)[..., None], axis=-1)[..., 0]
  # Subtract the shift before adding the large terms: exact when the label holds the max.
  # The sum of exponentials and the label's logit cross the TP group in one all-reduce.
  summed = tp_sum(jnp.stack([local_sum_exp, jnp.where(mine, picked - shift, 0.0)], axis=-1))
  return jnp.log(summed[..., 0]) - summed[..., 1]
