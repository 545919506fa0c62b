"""The contract between the library and a model: what a model gives the trainer and generation.

- ``spec``: ``ModelSpec`` (layouts of one TP group, a factory of the module, its
  loss and sizes, optional imported weights, a Hugging Face export and a cached
  forward) and ``load_model_spec``, which makes one from ``model.factory``
  (``"package.module:function"``) and the run's config.
- ``decoding``: ``Decoding``, the optional part of a spec that generation uses
  (``ModelSpec.decoding``), and ``CachedForward``, the module methods it calls:
  the empty KV cache and a forward of new positions over it.

The trainer (``ntp_jax.training``), generation (``ntp_jax.generate``) and the
Hugging Face export (``ntp_jax.interop.export_hf``) know a model only through
this contract; no module of the library imports a model (``models/``,
``examples/``): the factory is imported by name when a run names it.
``models.gpt:model_spec`` is the Llama-style GPT; docs/custom_model.md shows
a model of your own.
"""

from ntp_jax.model.decoding import Cache, CachedForward, Decoding
from ntp_jax.model.spec import Layouts, ModelSpec, load_model_spec

__all__ = ["Cache", "CachedForward", "Decoding", "Layouts", "ModelSpec", "load_model_spec"]
