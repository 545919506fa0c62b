"""Text generation from a trained or imported model on any TP plan, with a KV cache.

Any model whose ``ModelSpec`` has a ``decoding`` (``ntp_jax.model.Decoding``:
a module with a cached forward) decodes; the GPT of ``models/`` is one. Only
the spec is used: nothing here imports a model.

- ``decoder``: ``Decoder`` runs the model's cached forward in the padded blocks
  of its layouts (any TP degree, failed slots, shared KV groups): a prefill of
  the prompt, then one token per step over a cache split like the blocks.
- ``sampling``: greedy, or temperature and top-k sampling (seeded).
- ``origin``: the model's spec, its parameters (a ``placement.LogicalSource``)
  and its tokenizer from a Hugging Face folder or a run's checkpoint
  (``ntp_jax.training.stored_run``).
- ``prompt``: the tokenizer, checked against the model.
- ``cli``: ``python -m ntp_jax.generate`` (docs/generate.md).

Nothing is imported here, so that the command sets the CPU device count
before JAX starts.
"""
