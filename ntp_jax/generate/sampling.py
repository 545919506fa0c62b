"""Choosing the next token from logits: greedy, or sampled with a temperature and top-k."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ntp_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen (static: part of the compiled decoding program).

  Attributes:
    temperature: 0 picks the most likely token (greedy, the default); above 0
      the logits are divided by it and a token is drawn from their softmax.
    top_k: when sampling, draw among the ``top_k`` most likely tokens only
      (0: all). ``top_k=1`` is greedy (up to ties between equal logits).

  Raises:
    ConfigError: naming ``--temperature`` (negative or not finite) or
      ``--top-k`` (negative, or given with temperature 0).
  """

  temperature: float = 0.0
  top_k: int = 0

  def __post_init__(self):
    if not (self.temperature >= 0 and self.temperature != float("inf")):
      raise ConfigError(f"--temperature: must be a finite number >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ConfigError(f"--top-k: must be >= 0, got {self.top_k}")
    if self.top_k and self.temperature == 0:
      raise ConfigError(f"--top-k: {self.top_k} needs --temperature > 0 (temperature 0 is "
                        "greedy decoding)")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def describe(self) -> str:
    if self.greedy:
      return "greedy"
    return f"sampling at temperature {self.temperature:g}" + (
        f", top-k {self.top_k}" if self.top_k else "")


def next_token(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """int32 ``[batch]``: the token chosen from f32 ``logits [batch, vocab]``.

  Greedy takes the first index of the largest logit; sampling draws from
  ``softmax(logits / temperature)`` over the ``top_k`` largest (ties with the
  k-th largest kept) with ``key`` (a ``jax.random`` key; unused when greedy).
  """
  if sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits.astype(jnp.float32) / sampling.temperature
  if sampling.top_k and sampling.top_k < scaled.shape[-1]:
    kth = jax.lax.top_k(scaled, sampling.top_k)[0][..., -1:]
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
  return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
