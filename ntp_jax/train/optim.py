"""AdamW with warmup-cosine schedule, and global-norm clipping of logical gradients.

Weight decay applies to the split kernels and embeddings (``TPParam``), not to
RMSNorm scales. Padded entries stay exactly zero: their gradient is zero, so
both Adam moments and the decayed value stay zero.

Clipping is done here rather than by ``optax.clip_by_global_norm`` because a
class program stores one copy of the gradients per DP replica (see
``ntp_jax.sharding.shard.replica_specs``): the norm must count each logical element
once, not once per replica. Padding is zero, so it adds nothing.
Source: Loshchilov & Hutter, AdamW (arXiv:1711.05101); Pascanu et al.,
gradient clipping (arXiv:1211.5063).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from ntp_jax.layers.params import TPParam
from ntp_jax.train.config import TrainConfig


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
  """AdamW from the ``train`` section (``lr``, ``warmup_steps``, ``steps``,
  ``min_lr_ratio``, ``b1``, ``b2``, ``weight_decay``; checked by
  ``train.config``): linear warmup to ``lr``, cosine decay to
  ``lr * min_lr_ratio`` at ``steps``. Clipping is separate
  (``clip_by_logical_norm``).
  """
  warmup = min(train.warmup_steps, train.steps)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=train.lr, warmup_steps=warmup,
      decay_steps=max(train.steps, warmup + 1), end_value=train.lr * train.min_lr_ratio)
  return optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=1e-8,
                     weight_decay=train.weight_decay, mask=decay_mask)


def decay_mask(params: nnx.State) -> nnx.State:
  """True for ``TPParam`` (kernels, embeddings), False for replicated scales."""
  return jax.tree.map(lambda v: v.replace(isinstance(v, TPParam)), params,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def logical_norm(grads: nnx.State, replicas: int = 1, *, stacked: bool = False) -> jax.Array:
  """L2 norm of the logical gradient: each logical element counted once.

  Args:
    grads: gradients as padded blocks (padding is zero); with ``stacked``,
      replica-stacked (every replica's copy equal).
    replicas: length of the leading replica axis when ``stacked``.
    stacked: whether leaves carry a leading replica axis.

  Shared units (``Layout.shared_units``) are held by every slot; their
  squares are divided by the TP degree so they count once.
  """
  lead = 1 if stacked else 0
  total = jnp.zeros((), jnp.float32)
  for _, v in nnx.to_flat_state(grads):
    g = v.get_value().astype(jnp.float32)
    squares = g * g
    layout = getattr(v, "tp_layout", None)
    if isinstance(v, TPParam) and layout.shared_units:
      axis = lead + 1 + v.tp_axis
      shape = [1] * g.ndim
      shape[axis] = layout.block
      shared = jnp.arange(layout.block) >= layout.own_size
      squares = squares * jnp.where(shared, 1.0 / layout.degree, 1.0).reshape(shape)
    total = total + jnp.sum(squares)
  return jnp.sqrt(total / (replicas if stacked else 1))


def clip_by_logical_norm(grads: nnx.State, norm: jax.Array, clip_norm: float) -> nnx.State:
  """Scale ``grads`` by ``clip_norm / norm`` when ``norm > clip_norm`` (0 disables)."""
  if not clip_norm:
    return grads
  scale = jnp.where(norm > clip_norm, clip_norm / norm, 1.0)
  return jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
