"""Autoregressive decoding of any model with a cached forward, on one TP group.

The model is the training model: its module (``ntp_jax.model.Decoding.make``,
implementing ``ntp_jax.model.CachedForward``), its parameters in the padded
blocks of its layouts (any TP degree, failed slots, shared KV groups), on a
``('dp', 'tp')`` mesh of one row. One program runs the prompt (prefill) and
the same program, compiled for one token, runs every later step: the model's
``decode`` inside ``shard_map`` (the GPT's: the training layers, attention
over a KV cache, ``ntp_jax.layers.cached_attention``), plus one all-gather of
the last position's vocabulary blocks to choose the token. Every collective
is a ``'tp'`` all-reduce inside the ``shard_map`` body, as in training.

The cache is the pytree the module's ``cache_shapes`` gives (the GPT's: keys
and values ``[degree, n_layers, batch, max_len, heads, head_dim]`` in the
compute dtype), every leaf split on its leading slot axis: each device holds
its block.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.generate.sampling import Sampling, next_token
from ntp_jax.layers.shard import spec_shardings, state_specs
from ntp_jax.model import Cache, CachedForward
from ntp_jax.sharding.collectives import slot_position, tp_sum
from ntp_jax.sharding.mesh import TP


def gather_blocks(x: jax.Array, degree: int) -> jax.Array:
  """Inside ``shard_map``: ``[b, block]`` per slot -> ``[b, degree * block]`` on every slot.

  Each slot writes its block at its place in zeros and the TP group sums
  them (one all-reduce), so the result is the same on every slot, as
  ``out_specs=P()`` needs.
  """
  b, block = x.shape
  placed = jnp.zeros((b, degree * block), x.dtype)
  return tp_sum(jax.lax.dynamic_update_slice_in_dim(placed, x, slot_position() * block, axis=1))


@dataclasses.dataclass
class Generation:
  """What ``Decoder.generate`` returns.

  Attributes:
    tokens: int32 ``[batch, n]`` new tokens (``n`` = ``max_new_tokens``, or
      fewer when every row produced ``stop_token``; a row that stopped early
      repeats ``stop_token``).
    logits: when asked for, f32 ``[n, batch, vocab]``: the logits each token was
      chosen from (step 0: the prompt's last position).
    compile_s: seconds compiling the prompt's program and the step's (ahead of both).
    prefill_s: seconds of the prompt's program.
    decode_s: seconds of the steps after it.
  """

  tokens: np.ndarray
  logits: np.ndarray | None
  compile_s: float
  prefill_s: float
  decode_s: float


class Decoder:
  """Generates from a model with a cached forward on a one-row ``('dp', 'tp')`` mesh.

  Args:
    model: the module (an ``ntp_jax.model.CachedForward``: ``layouts``, ``cache_shapes``,
      ``decode``) with its parameters for ``mesh``'s layouts (the TP degree of
      ``model.layouts`` is ``mesh.shape['tp']``); placed onto the mesh here (a model
      already there is not copied).
    mesh: ``('dp', 'tp')`` with one row: the TP group's live slots.
    sampling: greedy (default) or sampled (``Sampling``).

  Raises:
    ValueError: the mesh has more than one row or another TP size than the
      model's layouts.
  """

  def __init__(self, model: CachedForward, mesh: Mesh, sampling: Sampling = Sampling()):
    degree = model.layouts.degree
    if mesh.devices.shape != (1, degree):
      raise ValueError(f"Decoder: the mesh is {mesh.devices.shape}; one row of the model's "
                       f"TP degree {degree} is needed")
    self.mesh = mesh
    self.sampling = sampling
    self.vocab = model.layouts.vocab
    self.graphdef, state = nnx.split(model)
    specs = state_specs(state)
    self.state = jax.device_put(state, spec_shardings(specs, mesh))
    self._cache_sharding = NamedSharding(mesh, P(TP))
    # Logical vocabulary order out of the gathered blocks: [degree * block] -> [vocab].
    scatter = jnp.asarray(self.vocab.scatter_index())

    def body(state, tokens, cache, offset, key):
      logits, cache = nnx.merge(self.graphdef, state).decode(tokens, cache, offset)
      logits = jnp.take(gather_blocks(logits.astype(jnp.float32), degree), scatter, axis=1)
      token = next_token(logits, jax.random.fold_in(key, offset), self.sampling)
      return token, logits, cache

    self._program = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, P(), P(TP), P(), P()),
                      out_specs=(P(), P(), P(TP))),
        donate_argnums=(2,))
    self._programs: dict[Any, Any] = {}

  def _compiled(self, batch: int, new: int, cache: Cache, key: jax.Array):
    """The program for ``new`` tokens per row on this cache, compiled ahead once and kept
    (calling the compiled object skips the jit's tracing)."""
    shape = (batch, new, tuple(leaf.shape for leaf in jax.tree.leaves(cache)))
    if shape not in self._programs:
      self._programs[shape] = self._program.lower(
          self.state, jax.ShapeDtypeStruct((batch, new), jnp.int32), cache, jnp.int32(0),
          key).compile()
    return self._programs[shape]

  def empty_cache(self, batch: int, max_len: int) -> Cache:
    """The model's cache of ``batch`` rows of up to ``max_len`` positions, zeros, every leaf
    split over the slots on its leading axis (the GPT's: keys and values ``[degree,
    n_layers, batch, max_len, heads, head_dim]`` in the compute dtype)."""
    shapes = nnx.merge(self.graphdef, self.state).cache_shapes(batch, max_len)
    return jax.tree.map(
        lambda s: jax.jit(lambda: jnp.zeros(s.shape, s.dtype),
                          out_shardings=self._cache_sharding)(), shapes)

  def generate(self, prompt: np.ndarray, max_new_tokens: int, *, seed: int = 0,
               stop_token: int | None = None, keep_logits: bool = False) -> Generation:
    """Continue every row of ``prompt`` by up to ``max_new_tokens`` tokens.

    Args:
      prompt: int ``[batch, length]`` token ids (rows of one length), ``length >= 1``.
      max_new_tokens: tokens to add, ``>= 1``.
      seed: the ``jax.random`` seed of sampling (step ``i`` draws with
        ``fold_in(key(seed), position)``): the same seed gives the same tokens.
      stop_token: stop once every row has produced it.
      keep_logits: return every step's logits (``Generation.logits``).

    Raises:
      ValueError: an empty prompt, ``max_new_tokens < 1``, or a token id
        outside the vocabulary (``model.layouts.vocab.size``).
    """
    prompt = np.asarray(prompt)
    if prompt.ndim != 2 or prompt.shape[1] < 1:
      raise ValueError(f"generate: the prompt must be [batch, length >= 1], got {prompt.shape}")
    if max_new_tokens < 1:
      raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt.min() < 0 or prompt.max() >= self.vocab.size:
      raise ValueError(f"generate: token ids must lie in [0, {self.vocab.size}), got "
                       f"{prompt.min()}..{prompt.max()}")
    batch, length = prompt.shape
    cache = self.empty_cache(batch, length + max_new_tokens)
    key = jax.random.key(seed)
    feed = jnp.asarray(prompt, jnp.int32)
    start = time.perf_counter()
    prefill, step_program = (self._compiled(batch, n, cache, key) for n in (length, 1))
    compile_s = time.perf_counter() - start
    tokens, logits = [], []
    done = np.zeros(batch, bool)
    offset, prefill_s, start = 0, 0.0, time.perf_counter()
    for step in range(max_new_tokens):
      program = prefill if step == 0 else step_program
      token, step_logits, cache = program(self.state, feed, cache, jnp.int32(offset), key)
      token = np.asarray(token)
      if stop_token is not None:
        token = np.where(done, stop_token, token)
        done |= token == stop_token
      tokens.append(token)
      if keep_logits:
        logits.append(np.asarray(step_logits))
      if step == 0:
        prefill_s = time.perf_counter() - start
      offset += feed.shape[1]
      feed = jnp.asarray(token[:, None], jnp.int32)
      if done.all():
        break
    return Generation(tokens=np.stack(tokens, axis=1).astype(np.int32),
                      logits=np.stack(logits) if keep_logits else None, compile_s=compile_s,
                      prefill_s=prefill_s, decode_s=time.perf_counter() - start - prefill_s)
