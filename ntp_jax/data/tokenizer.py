"""Byte-level BPE tokenizer trained offline on the corpus.

Byte-level means every byte has a token of its own before any merge, so any
text encodes (nothing is "unknown") and decoding gives back the exact input.
The `tokenizers` trainer is deterministic for a given input: the same corpus
and vocabulary size give the same merges, in any process.
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ntp_jax.data.errors import field_error

# Separator appended after each document in the packed token stream.
END_OF_TEXT = "<|endoftext|>"

# 256 byte tokens plus the separator: the smallest byte-level vocabulary.
MIN_VOCAB_SIZE = 256 + 1


def train_bpe_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
  """Trains a byte-level BPE tokenizer on `texts`.

  Args:
    texts: the training documents.
    vocab_size: vocabulary size to reach; the result has at most this many
      tokens (fewer when the corpus runs out of pairs to merge). The
      separator `END_OF_TEXT` is token 0.

  Returns:
    The trained `tokenizers.Tokenizer`.

  Raises:
    DataError: `vocab_size` is below `MIN_VOCAB_SIZE`.
  """
  check_vocab_size(vocab_size)
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=[END_OF_TEXT],
      # All 256 bytes up front, so bytes absent from this corpus still encode.
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  tokenizer.train_from_iterator(texts, trainer, length=len(texts))
  _treat_separator_in_text_as_text(tokenizer)
  return tokenizer


def check_vocab_size(vocab_size: int) -> None:
  """Raises DataError (naming the vocabulary field) if BPE cannot fit it."""
  if vocab_size < MIN_VOCAB_SIZE:
    raise field_error(
        "vocab_size", f"{vocab_size} is too small for a byte-level BPE "
        f"tokenizer; need at least {MIN_VOCAB_SIZE} (256 bytes + separator)")


def load_tokenizer(path: str) -> Tokenizer:
  """Loads a tokenizer saved with `Tokenizer.save` by this module.

  Args:
    path: the tokenizer JSON file.

  Returns:
    The tokenizer, set up as `train_bpe_tokenizer` returns it.
  """
  tokenizer = Tokenizer.from_file(path)
  _treat_separator_in_text_as_text(tokenizer)
  return tokenizer


def end_of_text_id(tokenizer: Tokenizer) -> int:
  """The token id of the document separator `END_OF_TEXT`."""
  token_id = tokenizer.token_to_id(END_OF_TEXT)
  if token_id is None:
    raise ValueError(f"tokenizer has no {END_OF_TEXT} token")
  return token_id


def _treat_separator_in_text_as_text(tokenizer: Tokenizer) -> None:
  # A document that happens to contain the literal "<|endoftext|>" (this
  # very file does) must not inject a separator: packing alone places them.
  tokenizer.encode_special_tokens = True
