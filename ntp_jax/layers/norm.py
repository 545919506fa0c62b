"""RMSNorm (Zhang & Sennrich, arXiv:1910.07467) on replicated activations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
  """``x / rms(x) * scale`` over the last axis; statistics in float32.

  Activations entering it are replicated over the TP group (never padded
  blocks), so no collective is needed and padding cannot leak into the mean.

  Parameters: ``scale`` f32 ``[d]`` (replicated, initialised to one).
  """

  def __init__(self, d: int, *, eps: float = 1e-5, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
    del rngs  # deterministic init; kept for a uniform layer signature
    self.eps = eps
    self.dtype = dtype
    self.scale = nnx.Param(jnp.ones((d,), param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * self.scale[...].astype(jnp.float32)).astype(self.dtype)
