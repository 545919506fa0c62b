"""A model of your own under NTP: a one-block MLP language model from ``ntp_jax.layers``.

Train it with the trainer by naming its factory in the config:

  python train.py --config configs/gpt_tiny.py --config.model.factory=examples.mlp_lm:model_spec \\
      --config.ntp.failed=3 --config.workdir=runs/mlp_lm

Every layer runs inside ``shard_map`` and sees this device's blocks; the
layouts say how each split dimension is divided over the live slots of one
TP group (any degree, any failed slots). See docs/custom_model.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ntp_jax.layers import (
  ColumnParallelLinear,
  RMSNorm,
  SwiGLU,
  VocabParallelEmbed,
  vocab_parallel_cross_entropy,
)
from ntp_jax.model import Decoding, ModelSpec
from ntp_jax.sharding.layout import Layout, make_layout


@dataclasses.dataclass(frozen=True)
class MLPLayouts:
  """How one TP group splits the hidden width and the vocabulary."""

  ffn: Layout
  vocab: Layout

  @property
  def degree(self) -> int:
    return self.ffn.degree


def mlp_layouts(d_ff: int, vocab_size: int, tp: int, failed=(), weights=None) -> MLPLayouts:
  return MLPLayouts(ffn=make_layout(d_ff, tp, failed=failed, weights=weights),
                    vocab=make_layout(vocab_size, tp, failed=failed, weights=weights))


class MLPLanguageModel(nnx.Module):
  """Embedding, one residual SwiGLU block, RMSNorm, vocabulary-parallel head.

  Each token's next-token logits depend on that token only: a bigram model,
  small enough to read in one screen.
  """

  def __init__(self, layouts: MLPLayouts, d_model: int, *, rngs: nnx.Rngs):
    self.layouts = layouts
    self.embed = VocabParallelEmbed(layouts.vocab, d_model, rngs=rngs)
    self.norm = RMSNorm(d_model)
    self.mlp = SwiGLU(d_model, layouts.ffn, rngs=rngs)
    self.head = ColumnParallelLinear(d_model, layouts.vocab, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """int ``[batch, seq]`` -> this slot's logits ``[batch, seq, vocab block]``."""
    x = self.embed(tokens)
    x = x + self.mlp(self.norm(x))
    return self.head(x)

  def loss_sum(self, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """f32 scalar: summed next-token cross-entropy of this device's rows."""
    return jnp.sum(vocab_parallel_cross_entropy(self(tokens), targets, self.layouts.vocab))

  # Decoding (ntp_jax.model.CachedForward): the next token depends on the last one only, so
  # there is nothing to cache.

  def cache_shapes(self, batch: int, max_len: int) -> tuple:
    """No cache: ``()``."""
    return ()

  def decode(self, tokens: jax.Array, cache: tuple, offset: jax.Array) -> tuple[jax.Array, tuple]:
    """int32 ``[batch, new]`` -> this slot's logits ``[batch, vocab block]`` of the last token."""
    return self(tokens[:, -1:])[:, 0], cache


def model_spec(config) -> ModelSpec:
  """The library's view of the model, from ``model.vocab_size``, ``d_model`` and ``d_ff``:
  it trains and decodes (``python -m ntp_jax.generate --from WORKDIR``)."""
  m, seed = config.model, config.train.seed
  d_model, d_ff, vocab = m.d_model, m.d_ff, m.vocab_size
  make = lambda layouts: MLPLanguageModel(layouts, d_model, rngs=nnx.Rngs(seed))  # noqa: E731
  return ModelSpec(
      layouts=lambda tp, failed, weights: mlp_layouts(d_ff, vocab, tp, failed, weights),
      make=make,
      vocab_size=vocab,
      param_count=2 * vocab * d_model + 3 * d_model * d_ff + d_model,
      name="mlp_lm",
      decoding=Decoding(make=make, fields={"vocab_size": vocab, "d_model": d_model, "d_ff": d_ff}))
