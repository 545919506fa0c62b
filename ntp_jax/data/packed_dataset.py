"""Packed sequences served in a seeded order, as a pure function of position.

The order is an endless walk over the sequences: epoch e visits them in a
random permutation drawn from `np.random.default_rng(seed + epoch)`, and walk
position p is offset p % num_sequences of epoch p // num_sequences. A reader
keeps a cursor, the number of sequences consumed so far, and asks for
`sequences(cursor, count)`; the batch size may change from one call to the
next. Nothing depends on which positions were asked for before, so a
restarted run resumes at any cursor with exactly the data it would have seen.
See docs/data.md for why the order is a numpy permutation and not grain's.
"""

import dataclasses
import threading

import numpy as np
from tokenizers import Tokenizer

from ntp_jax.data.errors import field_error


@dataclasses.dataclass(frozen=True)
class CorpusInfo:
  """Where a dataset came from, for logs.

  Attributes:
    source: human-readable origin (folder, file or pattern).
    num_files: files read (for a token file: 1).
    num_docs: documents in the stream, or None when unknown (token files).
    num_text_bytes: bytes of text tokenized, or None for token files.
    truncated: True when `max_corpus_bytes` cut the text short.
    num_tokens: tokens in the whole stream, separators included.
    tokenizer_path: the cached tokenizer JSON, or None for token files.
    from_cache: True when the tokenized corpus came from the workdir cache.
    tokenizer_origin: the tokenizer file given to `make_dataset` (the
      cached JSON is a copy of it), or None when a BPE was trained.
  """
  source: str
  num_files: int
  num_docs: int | None
  num_tokens: int
  tokenizer_path: str | None
  from_cache: bool
  num_text_bytes: int | None = None
  truncated: bool = False
  tokenizer_origin: str | None = None


class PackedDataset:
  """Fixed-length token sequences served in a seeded, resumable order.

  Attributes:
    split: "train" or "val".
    seq_len: tokens per training input; examples hold seq_len + 1 tokens.
    seed: seed of the order.
    vocab_size: the model vocabulary asked for; every token is below it.
    tokenizer: the trained tokenizer, or None for `.bin` token files.
    info: the `CorpusInfo` of the corpus.
    validation: the held-out `PackedDataset` (split "val") or None; set on
      the training split only.
  """

  def __init__(self, sequences: np.ndarray, *, split: str, seed: int,
               vocab_size: int, tokenizer: Tokenizer | None,
               info: CorpusInfo):
    """Wraps packed sequences.

    Args:
      sequences: shape [num_sequences, seq_len + 1], any unsigned int dtype;
        may be a memmap. Not copied.
      split: "train" or "val".
      seed: non-negative seed of the order.
      vocab_size: the model vocabulary.
      tokenizer: the tokenizer, or None.
      info: corpus origin, for `describe`.
    """
    self._sequences = sequences
    self.split = split
    self.seq_len = sequences.shape[1] - 1
    self.seed = seed
    self.vocab_size = vocab_size
    self.tokenizer = tokenizer
    self.info = info
    self.validation: PackedDataset | None = None
    # Permutations of the last epochs used: recomputing one is O(sequences)
    # per call, which shows for multi-GB token files. Only a cache: results
    # never depend on it.
    self._orders: dict[int, np.ndarray] = {}
    self._orders_lock = threading.Lock()

  @property
  def num_sequences(self) -> int:
    """Sequences of seq_len + 1 tokens in this split."""
    return self._sequences.shape[0]

  @property
  def num_tokens(self) -> int:
    """Tokens in the whole corpus stream (all splits, separators included)."""
    return self.info.num_tokens

  @property
  def tokenizer_path(self) -> str | None:
    """The cached tokenizer JSON, or None for token files."""
    return self.info.tokenizer_path

  @property
  def from_cache(self) -> bool:
    """Whether the tokenized corpus was reused from the workdir cache."""
    return self.info.from_cache

  def check_batch_size(self, batch_size: int) -> None:
    """Fails early when the split cannot fill one batch.

    Raises:
      DataError: `batch_size` is not positive (naming the batch size field)
        or exceeds the sequences in this split (naming data.path).
    """
    if not _is_int(batch_size) or batch_size < 1:
      raise field_error("batch_size", f"must be a positive integer, got "
                        f"{batch_size!r}")
    if batch_size > self.num_sequences:
      raise field_error(
          "path", f"the corpus gives only {self.num_sequences} {self.split} "
          f"sequences of {self.seq_len + 1} tokens, fewer than one batch of "
          f"{batch_size}; give more text or lower the batch size or seq_len")

  def sequence_ids(self, cursor: int, count: int) -> np.ndarray:
    """Which sequences the walk visits at positions [cursor, cursor + count).

    Args:
      cursor: non-negative walk position: sequences consumed so far.
      count: sequences to take, 1 to `num_sequences`; the range may straddle
        two epochs.

    Returns:
      int64 array [count] of row indices into this split's packed sequences.

    Raises:
      DataError: `count` is not a positive integer (naming the batch size
        field) or exceeds `num_sequences` (naming data.path); see
        `check_batch_size`.
      ValueError: `cursor` is negative or not an integer.
    """
    self.check_batch_size(count)
    if not _is_int(cursor) or cursor < 0:
      raise ValueError(f"cursor must be a non-negative integer, got "
                       f"{cursor!r}")
    # Python ints first: a cursor can pass int32 on long runs.
    first = int(cursor)
    positions = np.arange(first, first + int(count), dtype=np.int64)
    epochs, offsets = np.divmod(positions, self.num_sequences)
    ids = np.empty(int(count), dtype=np.int64)
    for epoch in np.unique(epochs):
      in_epoch = epochs == epoch
      ids[in_epoch] = self.epoch_order(int(epoch))[offsets[in_epoch]]
    return ids

  def sequences(self, cursor: int, count: int) -> np.ndarray:
    """The sequences at walk positions [cursor, cursor + count).

    Args:
      cursor: non-negative walk position: sequences consumed so far.
      count: sequences to take, 1 to `num_sequences`.

    Returns:
      int32 array [count, seq_len + 1]: row i is packed sequence
      `sequence_ids(cursor, count)[i]`; inputs are [:, :-1], targets [:, 1:].

    Raises:
      DataError, ValueError: see `sequence_ids`.
    """
    ids = self.sequence_ids(cursor, count)
    return np.asarray(self._sequences[ids], dtype=np.int32)

  def batch(self, step: int, batch_size: int) -> np.ndarray:
    """The batch of a step at a fixed batch size: `sequences(step * bs, bs)`.

    Args:
      step: non-negative step index; any order of calls gives the same data.
      batch_size: sequences per batch, at most `num_sequences`.

    Returns:
      int32 array [batch_size, seq_len + 1].

    Raises:
      DataError: see `check_batch_size`.
      ValueError: `step` is negative or not an integer.
    """
    self.check_batch_size(batch_size)
    if not _is_int(step) or step < 0:
      raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return self.sequences(int(step) * int(batch_size), batch_size)

  def epoch_order(self, epoch: int) -> np.ndarray:
    """Sequence indices in the order epoch `epoch` visits them.

    Returns:
      int64 permutation of range(num_sequences), from
      `np.random.default_rng(seed + epoch)`.
    """
    with self._orders_lock:
      order = self._orders.get(epoch)
      if order is None:
        order = np.random.default_rng(self.seed + epoch).permutation(
            self.num_sequences)
        # Two epochs cover a batch straddling an epoch boundary.
        if len(self._orders) >= 2:
          self._orders.pop(min(self._orders))
        self._orders[epoch] = order
      return order

  def describe(self) -> str:
    """A few short lines for logs: where the text came from, the split, the tokenizer."""
    info = self.info
    origin = f"data: {info.source}, {info.num_files:,} file(s)"
    if info.num_docs is not None:
      origin += f", {info.num_docs:,} docs"
    if info.num_text_bytes is not None:
      origin += f", {info.num_text_bytes:,} bytes" + (
          " (cut at data.max_corpus_bytes)" if info.truncated else "")
    val = self.validation.num_sequences if self.validation is not None else 0
    counts = (f"{self.num_sequences:,} {self.split}" if self.split != "train" else
              f"{self.num_sequences:,} train + {val:,} val")
    split = (f"  {info.num_tokens:,} tokens -> {counts} sequences of {self.seq_len + 1} "
             f"tokens (order seed {self.seed})")
    if info.tokenizer_path is None or info.num_docs is None:
      tokenizer = f"  pre-tokenized, vocabulary {self.vocab_size:,}"
      if info.tokenizer_path is not None:  # a token set's copy of its tokenizer
        tokenizer += f", tokenizer {info.tokenizer_path}"
    else:
      copy = f", copy of {info.tokenizer_origin}" if info.tokenizer_origin else ""
      tokenizer = (f"  tokenizer: {info.tokenizer_path} "
                   f"({self.tokenizer.get_vocab_size():,} tokens{copy})")
    if info.num_docs is None:  # ids read as they are: only their largest was scanned
      tokenizer += ", largest id from cache" if info.from_cache else ", ids scanned"
    else:
      tokenizer += ", reused from cache" if info.from_cache else ", built"
    return "\n".join([origin, split, tokenizer])


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
