"""Rotary position embedding (Su et al., RoFormer, arXiv:2104.09864).

Rotates pairs ``(x[i], x[i + head_dim/2])`` (the "half" convention of
Llama's reference code) by ``position * theta**(-2i/head_dim)``. Works on any
number of local heads, so it is unaffected by the TP split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin: f32 ``[..., seq, head_dim/2]`` for int ``positions [..., seq]``.

  Raises:
    ValueError: odd ``head_dim``.
  """
  if head_dim % 2:
    raise ValueError(f"model.head_dim: RoPE needs an even head_dim, got {head_dim}")
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate ``x: [batch, seq, heads, head_dim]`` with ``cos, sin: [batch|1, seq, head_dim/2]``."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos[..., None, :], sin[..., None, :]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)
