"""Byte-level BPE tokenizer trained offline on the corpus, or a given one.

Byte-level means every byte has a token of its own before any merge, so any
text encodes (nothing is "unknown") and decoding gives back the exact input.
The `tokenizers` trainer is deterministic for a given input: the same corpus
and vocabulary size give the same merges, in any process. A model's own
`tokenizer.json` (Hugging Face `tokenizers` format) is used as it is
(`load_given_tokenizer`).
"""

import os
import shutil

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ntp_jax.data.errors import field_error

# Separator appended after each document in the packed token stream.
END_OF_TEXT = "<|endoftext|>"

# Separators looked for, in this order, in a tokenizer: ours first (GPT-2's
# too), then Llama 3's, Llama 2's / SentencePiece's, Gemma's.
END_OF_TEXT_TOKENS = (END_OF_TEXT, "<|end_of_text|>", "</s>", "<eos>")

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


def load_given_tokenizer(path: str, vocab_size: int) -> Tokenizer:
  """Loads a model's own tokenizer JSON and checks it fits the model.

  Args:
    path: a `tokenizers` JSON file (a Hugging Face `tokenizer.json`).
    vocab_size: the model vocabulary; every id of the tokenizer must be
      below it.

  Returns:
    The tokenizer, special tokens in the text encoded as text (as
    `load_tokenizer`).

  Raises:
    DataError: one line naming the file: it is missing or unreadable (naming
      model.init_from), has none of `END_OF_TEXT_TOKENS` (model.init_from),
      or has more tokens than `vocab_size` (model.vocab_size).
  """
  if not os.path.isfile(path):
    raise field_error("tokenizer_path", f"no tokenizer file {path}")
  try:
    tokenizer = load_tokenizer(path)
  except Exception as e:  # pylint: disable=broad-except  (tokenizers raises bare Exception)
    raise field_error("tokenizer_path", f"cannot read {path} as a tokenizers JSON file "
                      f"({type(e).__name__}: {e})") from None
  vocab = tokenizer.get_vocab(with_added_tokens=True)
  size = max(tokenizer.get_vocab_size(with_added_tokens=True),
             max(vocab.values(), default=-1) + 1)
  if size > vocab_size:
    raise field_error("vocab_size", f"{vocab_size:,} is fewer than the {size:,} token ids of "
                      f"{path}; the model's vocabulary must hold every id of its tokenizer")
  if not any(token in vocab for token in END_OF_TEXT_TOKENS):
    raise field_error("tokenizer_path", f"{path} has none of the end-of-text tokens "
                      f"{', '.join(END_OF_TEXT_TOKENS)} to separate documents with")
  return tokenizer


def end_of_text_id(tokenizer: Tokenizer) -> int:
  """The token id of the document separator: the first of `END_OF_TEXT_TOKENS` present.

  Raises:
    ValueError: the tokenizer has none of them.
  """
  for token in END_OF_TEXT_TOKENS:
    token_id = tokenizer.token_to_id(token)
    if token_id is not None:
      return token_id
  raise ValueError(f"tokenizer has none of {', '.join(END_OF_TEXT_TOKENS)}")


def _treat_separator_in_text_as_text(tokenizer: Tokenizer) -> None:
  # A document that happens to contain the literal "<|endoftext|>" (this
  # very file does) must not inject a separator: packing alone places them.
  tokenizer.encode_special_tokens = True


def copy_file(source: str, target: str) -> None:
  """Copy ``source`` to ``target`` whole (a temporary name, then renamed), with the mode a
  new file gets (``copyfile`` copies no permission bits)."""
  partial = f"{target}.partial"
  shutil.copyfile(source, partial)
  os.replace(partial, target)
