"""What generation needs of a model: a module with a cached forward (``ModelSpec.decoding``).

``ntp_jax.generate`` decodes any model whose spec has a ``Decoding``: it builds
``Decoding.make(layouts)`` for one TP group, fills its parameters from a
checkpoint or from ``ModelSpec.initial_source``, and runs the module's
``decode`` inside ``shard_map`` over the cache ``cache_shapes`` describes
(``CachedForward``). A spec without one (``decoding=None``) trains and
exports as before; generation refuses it in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax

Cache = Any  # a pytree of arrays, each ``[degree, ...]``: split over the slots on axis 0


class CachedForward(Protocol):
  """The module generation runs (``Decoding.make``), in the local view like ``__call__``.

  Attributes:
    layouts: the module's layouts (``ModelSpec.layouts``' value): ``degree``, and
      ``vocab``, the ``ntp_jax.sharding.layout.Layout`` of its logits' vocabulary
      blocks (``vocab.size`` token ids).
  """

  layouts: Any

  def cache_shapes(self, batch: int, max_len: int) -> Cache:
    """The empty cache of ``batch`` rows of up to ``max_len`` positions.

    Called outside ``shard_map``. Returns a pytree of ``jax.ShapeDtypeStruct`` of
    global shapes ``[degree, ...]``: slot ``i`` holds ``[1, ...]`` at index ``i``
    (e.g. the GPT's keys and values ``[degree, n_layers, batch, max_len, heads,
    head_dim]`` in the compute dtype); ``()`` for a model that needs none.
    """

  def decode(self, tokens: jax.Array, cache: Cache, offset: jax.Array
             ) -> tuple[jax.Array, Cache]:
    """Inside ``shard_map``: the logits of the last new position, the cache updated.

    Args:
      tokens: int32 ``[batch, new]``, the tokens at positions ``offset .. offset + new - 1``
        (the prompt, then one token per step).
      cache: this slot's part of the cache (``[1, ...]`` per leaf).
      offset: int32 scalar, the positions already in the cache.

    Returns:
      ``(logits, cache)``: this slot's vocabulary block ``[batch, vocab.block]`` of
      position ``offset + new - 1`` (zero in padding rows), and the cache with the
      new positions written (the same pytree, shapes and dtypes).
    """


@dataclasses.dataclass(frozen=True)
class Decoding:
  """How a model decodes: the optional ``ModelSpec.decoding``.

  Attributes:
    make: ``layouts -> module``: a ``CachedForward`` with the same parameters as
      ``ModelSpec.make``'s (paths and logical shapes: generation fills them from a
      checkpoint or ``ModelSpec.initial_source``); often ``ModelSpec.make`` itself.
    fields: the ``model`` section's fields with the values the spec was made of
      (the factory's defaults filled in): generation checks and types
      ``--config.model.FIELD=VALUE`` by them. None: by the stored config's
      ``model`` section.
    max_len: the longest sequence (prompt and continuation) the parameters of
      ``ModelSpec.initial_source`` are meant for, e.g. a Hugging Face folder's
      ``max_position_embeddings`` (``--from hf:FOLDER``), or None: not known.
      A run's checkpoint is decoded up to its ``train.seq_len``.
    max_len_field: where ``max_len`` comes from, for errors.
    describe: ``layouts -> str``, the tail of generation's plan line (the GPT:
      ``"KV groups 1,1,1 +1 shared"``), or None.
  """

  make: Callable[[Any], CachedForward]
  fields: Mapping[str, Any] | None = None
  max_len: int | None = None
  max_len_field: str = ""
  describe: Callable[[Any], str] | None = None
