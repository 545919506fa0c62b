"""Text in and out of a model: the prompt's token ids, the continuation's text."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from ntp_jax.data.tokenizer import END_OF_TEXT_TOKENS
from ntp_jax.errors import ConfigError
from ntp_jax.generate.origin import Origin


class PromptCodec:
  """The tokenizer of an ``Origin``, checked against its model.

  A run's own tokenizer encodes as the training text was encoded (no special
  tokens added, a literal ``<|endoftext|>`` in the prompt is text); a Hugging
  Face tokenizer adds its special tokens (Llama's BOS) as its
  ``post_processor`` says. ``stop_token`` is the first of
  ``END_OF_TEXT_TOKENS`` the tokenizer has (None if none).

  Raises:
    ConfigError: naming the file: unreadable, or with token ids outside the
      model's vocabulary (``model.vocab_size``).
  """

  def __init__(self, origin: Origin):
    path = origin.tokenizer
    try:
      self.tokenizer = Tokenizer.from_file(path)
    except Exception as err:  # tokenizers raises bare Exceptions
      raise ConfigError(f"{path}: cannot read it as a tokenizers JSON file "
                        f"({type(err).__name__}: {' '.join(str(err).split())[:160]})") from None
    self.special_tokens = origin.special_tokens
    if not origin.special_tokens:
      self.tokenizer.encode_special_tokens = True
    vocab = self.tokenizer.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1
    if size > origin.spec.vocab_size:
      raise ConfigError(f"{path}: token ids up to {size - 1}, but the model's vocabulary "
                        f"(model.vocab_size) is {origin.spec.vocab_size}")
    self.stop_token = next((vocab[t] for t in END_OF_TEXT_TOKENS if t in vocab), None)

  def encode(self, text: str) -> np.ndarray:
    """int32 ``[length]`` token ids of ``text``.

    Raises:
      ConfigError: naming ``--prompt`` when ``text`` gives no tokens.
    """
    ids = self.tokenizer.encode(text, add_special_tokens=self.special_tokens).ids
    if not ids:
      raise ConfigError(f"--prompt: {text!r} encodes to no tokens; give some text")
    return np.asarray(ids, np.int32)

  def decode(self, ids: list[int]) -> str:
    """The text of ``ids``, special tokens left out."""
    return self.tokenizer.decode(ids, skip_special_tokens=True)
