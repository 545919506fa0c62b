"""AdamW with warmup-cosine schedule and global-norm clipping (optax).

Weight decay applies to matrices (``ndim > 1``: every padded-block kernel
and embedding), not to RMSNorm scales. Padded entries stay exactly zero:
their gradient is zero, so both Adam moments and the decayed value are zero.
Source: Loshchilov & Hutter, AdamW (arXiv:1711.05101).
"""

from __future__ import annotations

import jax
import optax


def make_optimizer(train_cfg) -> optax.GradientTransformation:
  """From the ``train`` config section: ``lr``, ``warmup_steps``, ``steps``,
  ``min_lr_ratio``, ``b1``, ``b2``, ``weight_decay``, ``clip_norm``.

  Raises:
    ValueError: naming the field, for a negative learning rate, clip norm or steps.
  """
  for name in ("lr", "clip_norm", "weight_decay"):
    if train_cfg[name] < 0:
      raise ValueError(f"train.{name}: must be >= 0, got {train_cfg[name]}")
  if train_cfg.steps < 1:
    raise ValueError(f"train.steps: must be >= 1, got {train_cfg.steps}")
  warmup = min(train_cfg.warmup_steps, train_cfg.steps)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train_cfg.lr, warmup_steps=warmup,
      decay_steps=max(train_cfg.steps, warmup + 1),
      end_value=train_cfg.lr * train_cfg.min_lr_ratio)
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)
  return optax.chain(
      optax.clip_by_global_norm(train_cfg.clip_norm),
      optax.adamw(schedule, b1=train_cfg.b1, b2=train_cfg.b2, eps=1e-8,
                  weight_decay=train_cfg.weight_decay, mask=decay_mask),
  )
