"""What the library needs of a model: its layouts, a factory, a loss, and a few sizes.

The library does not know any model. ``model.factory`` in the config names a
function ``"package.module:function"`` that takes the whole config and
returns a ``ModelSpec``; ``models.gpt:model_spec`` is the Llama-style GPT.
A model of your own is any Flax NNX module built from ``ntp_jax.layers``
whose ``__call__`` runs inside ``shard_map`` (see docs/custom_model.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from ntp_jax.errors import ConfigError
from ntp_jax.model.decoding import Decoding
from ntp_jax.parallel.steps import default_loss
from ntp_jax.state.placement import LogicalSource

Layouts = Any  # a model's layouts of one TP group; must be hashable and have ``degree``


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A model as the trainer, generation and the export use it.

  Attributes:
    layouts: ``(tp, failed_slots, slot_weights) -> layouts`` of one TP group
      (``plan.make_plan`` groups replicas by equal layouts and batch shares).
    make: ``layouts -> module``. The same seed must give the same logical
      parameters for every layout (draw logical arrays, then split them, as
      ``layers.tp_param`` does).
    vocab_size: token ids the model takes (the data is tokenized to it).
    param_count: logical parameters (for reports).
    loss: ``(module, tokens, targets) -> f32 scalar``: the sum of the
      per-token loss over this device's rows (int32 ``[rows, seq]`` each),
      called inside ``shard_map``.
    n_layers: repeated layers, when the flops are to be counted from
      ``unrolled``; None counts the compiled program as is.
    unrolled: ``n -> ModelSpec`` of the same model with ``n`` layers and no
      loop (XLA's cost analysis counts a loop body once; see
      ``footprint.per_device_flops``), or None.
    layers: ``n -> ModelSpec`` of the same model with ``n`` layers, as configured
      otherwise (scanned or not): the memory plan of a model whose step cannot be
      built at full depth is extended from two smaller ones (``resources.footprint``);
      None: it is not.
    name: for logs.
    initial_source: ``() -> LogicalSource`` (``ntp_jax.state.placement``) of the
      parameters a fresh run starts from (no checkpoint to resume, or a
      restart before the first checkpoint) instead of ``make``'s own
      initialisation, e.g. ``ntp_jax.interop.hf_llama.HFSource``; None: ``make``'s.
      Called when needed (once per start or restart); a ``describe() -> str``
      method on the source, if any, gives the trainer's log line.
    tokenizer_file: a ``tokenizers`` JSON file (``tokenizer.json``) the
      training text is encoded with instead of a BPE trained on the corpus
      (``ntp_jax.data.make_dataset``'s ``tokenizer_path``); None trains one.
    export_hf: ``(logical_params, folder, *, max_position_embeddings) -> None``
      writes the model's logical parameters as a Hugging Face folder
      (``python -m ntp_jax.interop.export_hf``), or None: no such format.
    decoding: how the model decodes with a cache (``ntp_jax.model.decoding.Decoding``:
      ``python -m ntp_jax.generate``), or None: it cannot (generation refuses it
      in one line).
  """

  layouts: Callable[[int, Sequence[int], Sequence[float] | None], Layouts]
  make: Callable[[Layouts], nnx.Module]
  vocab_size: int
  param_count: int
  loss: Callable[[nnx.Module, jax.Array, jax.Array], jax.Array] = default_loss
  n_layers: int | None = None
  unrolled: Callable[[int], ModelSpec] | None = None
  layers: Callable[[int], ModelSpec] | None = None
  name: str = "model"
  initial_source: Callable[[], LogicalSource] | None = None
  tokenizer_file: str | None = None
  export_hf: Callable[..., None] | None = None
  decoding: Decoding | None = None


def load_model_spec(factory: str, config: Any) -> ModelSpec:
  """The ``ModelSpec`` that ``factory`` (``"module:function"``, ``model.factory``) makes
  of ``config`` (the run's ``ConfigDict``: the factory reads its ``model`` section).

  Raises:
    ConfigError: naming ``model.factory`` when it is malformed, cannot be
      imported, or does not return a ``ModelSpec``.
  """
  module_name, _, function = factory.partition(":")
  if not module_name or not function:
    raise ConfigError(f"model.factory: {factory!r} is not 'package.module:function'")
  try:
    module = importlib.import_module(module_name)
  except ImportError as err:
    raise ConfigError(f"model.factory: cannot import {module_name!r} ({err})") from None
  make = getattr(module, function, None)
  if make is None:
    raise ConfigError(f"model.factory: {module_name!r} has no {function!r}")
  spec = make(config)
  if not isinstance(spec, ModelSpec):
    raise ConfigError(f"model.factory: {factory} returned {type(spec).__name__}, "
                      "not a ModelSpec")
  return spec
