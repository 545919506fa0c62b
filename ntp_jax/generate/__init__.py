"""Text generation from a trained or imported GPT on any TP plan, with a KV cache.

- ``decoder``: ``Decoder`` runs ``models.gpt.GPT`` in the padded blocks of its
  layouts (any TP degree, failed slots, shared KV groups): a prefill of the
  prompt, then one token per step over a KV cache split like the heads.
- ``sampling``: greedy, or temperature and top-k sampling (seeded).
- ``origin``: the model, its parameters (a ``placement.LogicalSource``) and
  its tokenizer from a Hugging Face folder or a run's checkpoint.
- ``prompt``: the tokenizer, checked against the model.
- ``cli``: ``python -m ntp_jax.generate`` (docs/generate.md).

Nothing is imported here, so that the command sets the CPU device count
before JAX starts.
"""
