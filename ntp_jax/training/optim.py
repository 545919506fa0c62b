"""AdamW with a warmup-cosine schedule, from the ``train`` section.

Weight decay applies to the split kernels and embeddings (``TPParam``), not to
RMSNorm scales. Padded entries stay exactly zero: their gradient is zero, so
both Adam moments and the decayed value stay zero. Clipping by the logical
gradient norm is the class step's (``parallel.grad_norm``). Parameters stored
in bfloat16 (``model.param_dtype``) are stepped through float32 master
weights kept in the optimizer state (``parallel.master_weights``).
Source: Loshchilov & Hutter, AdamW (arXiv:1711.05101).
"""

from __future__ import annotations

import jax
import optax
from flax import nnx

from ntp_jax.layers.params import TPParam
from ntp_jax.parallel.master_weights import with_master_weights
from ntp_jax.parallel.zero import ZeroSettings
from ntp_jax.training.config import TrainConfig


def make_optimizer(train: TrainConfig, *, masked: bool = True) -> optax.GradientTransformation:
  """AdamW from the ``train`` section (``lr``, ``warmup_steps``, ``schedule_steps``,
  ``min_lr_ratio``, ``b1``, ``b2``, ``weight_decay``; checked by
  ``training.config``): linear warmup to ``lr``, cosine decay to
  ``lr * min_lr_ratio`` at ``schedule_steps`` (``train.steps`` unless set).
  Clipping is separate (``clip_by_logical_norm``). ``masked=False``: every
  element decays (for flat buffers whose mask is applied per element,
  ``zero_settings``). Parameters stored in less than float32 get float32
  master weights and moments (``with_master_weights``; the sharded
  optimizer's pieces are float32 already, so it is AdamW itself there).
  """
  length = train.schedule_steps or train.steps  # 0 (a section read as it is): train.steps
  warmup = min(train.warmup_steps, length)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train.lr, warmup_steps=warmup,
      decay_steps=max(length, warmup + 1), end_value=train.lr * train.min_lr_ratio)
  adamw = optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=1e-8,
                      weight_decay=train.weight_decay, mask=decay_mask if masked else None)
  return with_master_weights(adamw)


def zero_settings(train: TrainConfig) -> ZeroSettings | None:
  """The sharded optimizer of ``train.optimizer_sharding`` (None: replicated): the same
  AdamW on flat pieces, ``decay_mask`` applied per element."""
  if train.optimizer_sharding == "replicated":
    return None
  return ZeroSettings(make_optimizer(train, masked=False), decay_mask, train.clip_norm,
                      train.optimizer_copies, stage=int(train.optimizer_sharding[-1]))


def decay_mask(params: nnx.State) -> nnx.State:
  """True for ``TPParam`` (kernels, embeddings), False for replicated scales."""
  return jax.tree.map(lambda v: v.replace(isinstance(v, TPParam)), params,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))
