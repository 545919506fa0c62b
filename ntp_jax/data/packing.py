"""Packing documents into one token stream and cutting it into sequences.

Documents are joined end to end, each followed by the separator token, and
the stream is cut into back-to-back sequences of seq_len + 1 tokens (inputs
plus the targets shifted by one); the tail too short for a sequence is
dropped. A sequence may span a document boundary, as in GPT-2 style
pretraining: the separator tells the model where one text ends.
"""

import numpy as np
from tokenizers import Tokenizer

# Characters encoded per `encode_batch` call: large enough to keep all cores
# busy, small enough that the per-token `Encoding` objects (offsets, masks:
# tens of bytes per token) stay far below the size of the corpus.
_ENCODE_CHUNK_CHARS = 4_000_000


def token_dtype(vocab_size: int) -> np.dtype:
  """Smallest unsigned dtype holding ids below `vocab_size` (uint16/32)."""
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def encode_documents(tokenizer: Tokenizer, texts: list[str], separator_id: int,
                     dtype: np.dtype) -> np.ndarray:
  """Encodes documents into one stream, a separator after each document.

  Args:
    tokenizer: the tokenizer to encode with.
    texts: the documents, in order.
    separator_id: token id appended after every document.
    dtype: integer dtype of the result; must hold every id.

  Returns:
    The token stream, shape [sum of document lengths + len(texts)], `dtype`.
  """
  separator = np.array([separator_id], dtype=dtype)
  pieces = []
  for chunk in _chunks_by_size(texts, _ENCODE_CHUNK_CHARS):
    for encoding in tokenizer.encode_batch(chunk, add_special_tokens=False):
      pieces.append(np.asarray(encoding.ids, dtype=dtype))
      pieces.append(separator)
  if not pieces:
    return np.zeros(0, dtype)
  return np.concatenate(pieces)


def num_sequences(num_tokens: int, seq_len: int) -> int:
  """How many whole sequences of seq_len + 1 tokens a stream holds."""
  return num_tokens // (seq_len + 1)


def cut_into_sequences(tokens: np.ndarray, seq_len: int) -> np.ndarray:
  """Views a token stream as back-to-back sequences, dropping the tail.

  Args:
    tokens: the stream, shape [num_tokens]; may be a memmap (no copy made).
    seq_len: tokens per training input.

  Returns:
    A view of shape [num_tokens // (seq_len + 1), seq_len + 1], same dtype.
  """
  count = num_sequences(tokens.size, seq_len)
  return tokens[:count * (seq_len + 1)].reshape(count, seq_len + 1)


def _chunks_by_size(texts: list[str], max_chars: int):
  chunk, chunk_chars = [], 0
  for text in texts:
    if chunk and chunk_chars + len(text) > max_chars:
      yield chunk
      chunk, chunk_chars = [], 0
    chunk.append(text)
    chunk_chars += len(text)
  if chunk:
    yield chunk
