"""The norm of the logical gradient, and clipping by it.

Clipping is done here rather than by ``optax.clip_by_global_norm`` because a
class program stores one copy of the gradients per DP replica (see
``ntp_jax.layers.shard.replica_specs``): the norm must count each logical
element once, not once per replica. Padding is zero, so it adds nothing;
shared units (held by every slot) count once. Source: Pascanu et al.,
gradient clipping (arXiv:1211.5063).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ntp_jax.layers.params import TPParam


def logical_norm(grads: nnx.State, replicas: int = 1, *, stacked: bool = False,
                 per_replica: bool = False) -> jax.Array:
  """L2 norm of the logical gradient: each logical element counted once.

  Args:
    grads: gradients as padded blocks (padding is zero); with ``stacked``,
      replica-stacked (every replica's copy equal).
    replicas: length of the leading replica axis when ``stacked``.
    stacked: whether leaves carry a leading replica axis.
    per_replica: (stacked) each replica's copy's norm, f32 ``[replicas]``, all equal:
      summed within each replica only, so a class program that computes it runs no
      collective across replicas.

  Shared units (``Layout.shared_units``) are held by every slot; their
  squares are divided by the TP degree so they count once.
  """
  lead = 1 if stacked else 0
  total = jnp.zeros((), jnp.float32)
  for _, v in nnx.to_flat_state(grads):
    g = v.get_value().astype(jnp.float32)
    squares = g * g
    if isinstance(v, TPParam) and v.tp_layout.shared_units:
      layout = v.tp_layout
      axis = lead + 1 + v.tp_axis
      shape = [1] * g.ndim
      shape[axis] = layout.block
      shared = jnp.arange(layout.block) >= layout.own_size
      squares = squares * jnp.where(shared, 1.0 / layout.degree, 1.0).reshape(shape)
    total = total + (jnp.sum(squares, axis=tuple(range(1, g.ndim))) if per_replica
                     else jnp.sum(squares))
  if per_replica:
    return jnp.sqrt(total)
  return jnp.sqrt(total / (replicas if stacked else 1))


def clip_by_logical_norm(grads: nnx.State, norm: jax.Array, clip_norm: float) -> nnx.State:
  """Scale ``grads`` by ``clip_norm / norm`` when ``norm > clip_norm`` (0 disables).

  ``norm``: a scalar, or f32 ``[replicas]`` (``logical_norm(per_replica=True)``) for
  replica-stacked ``grads``, each replica scaled by its own.
  """
  if not clip_norm:
    return grads
  scale = jnp.where(norm > clip_norm, clip_norm / norm, 1.0)

  def clip(g):
    by_row = scale.reshape(scale.shape + (1,) * (g.ndim - scale.ndim))
    return (g * by_row).astype(g.dtype)
  return jax.tree.map(clip, grads)
