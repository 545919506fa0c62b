"""`make_dataset`: from the `data.*` settings to a ready `PackedDataset`.

Text is tokenized once per (input files, vocabulary size, byte budget, and
the given tokenizer file if any) and cached in the workdir: the tokenizer
JSON (trained, or a copy of the given one) and the token stream (`.npy`). A
second call with the same inputs loads both from there instead of training,
after checking their sizes and checksums; a damaged entry is rebuilt (see
`cache`).
"""

import os
import shutil

import numpy as np

from ntp_jax.data import cache, corpus, packing, token_file
from ntp_jax.data import tokenizer as tokenizer_lib
from ntp_jax.data.errors import DataError, field_error
from ntp_jax.data.packed_dataset import CorpusInfo, PackedDataset
from ntp_jax.data.sharded_rows import ShardedRows

TOKENIZER_FILE = "tokenizer.json"
TOKENS_FILE = "tokens.npy"


def make_dataset(path: str | None, vocab_size: int, seq_len: int,
                 cache_dir: str, seed: int,
                 max_corpus_bytes: int | None = 8_000_000,
                 val_fraction: float = 0.0,
                 tokenizer_path: str | None = None) -> PackedDataset:
  """Builds (or loads from cache) the packed training data.

  Args:
    path: None or "" for the interpreter's standard-library source; else a
      text file, folder (recursive, binary files skipped), glob pattern,
      one `.bin` file of little-endian uint16 tokens, or a token set (its
      folder, its manifest, or one shard; `token_set`: uint32 shards for
      vocabularies past 65,536, written by `build_tokens`).
    vocab_size: the model vocabulary; the BPE tokenizer gets at most this
      many tokens (at least 257 for text), a given tokenizer must have no
      more, and `.bin` tokens must be below it.
    seq_len: tokens per training input; each example holds seq_len + 1.
    cache_dir: the workdir; the cache lives in `<cache_dir>/data/`.
    seed: non-negative seed of the sequence order.
    max_corpus_bytes: text is read (files in sorted order) until this many
      bytes; None reads everything. Ignored for `.bin` files.
    val_fraction: share of sequences, taken from the end of the stream
      before shuffling, held out as `dataset.validation` (at least one
      sequence when positive).
    tokenizer_path: a `tokenizers` JSON file (a model's `tokenizer.json`)
      to encode the text with instead of training a BPE; documents are
      separated by its first token of `tokenizer.END_OF_TEXT_TOKENS`. The
      cache entry is keyed by the file's fingerprint and holds a copy of it
      (`tokenizer_path` of the result). Ignored for `.bin` token files (a
      token set's own tokenizer copy, when it has one, is the result's).

  Returns:
    The training split, a `PackedDataset`; its `validation` attribute holds
    the held-out split or None.

  Raises:
    DataError: a bad setting or input, as one line naming the config field:
      missing path, no match, unreadable, binary or empty corpus, too few
      tokens for one sequence, token id >= vocab_size, and so on; a given
      tokenizer that is unreadable, has no end-of-text token or more tokens
      than vocab_size (see `tokenizer.load_given_tokenizer`).
  """
  _check_settings(vocab_size, seq_len, cache_dir, seed, max_corpus_bytes,
                  val_fraction)
  source = corpus.resolve_source(path)
  if isinstance(source, corpus.TokenFileSource):
    shards, tokenizer, info = _load_token_files(source, vocab_size, cache_dir)
    sequences = _shard_rows(shards, seq_len)
  else:
    if tokenizer_path is not None:
      given = tokenizer_lib.load_given_tokenizer(tokenizer_path, vocab_size)
      tokens, tokenizer, info = _load_or_tokenize_text(
          source, vocab_size, cache_dir, max_corpus_bytes, (tokenizer_path, given))
    else:
      tokenizer_lib.check_vocab_size(vocab_size)
      tokens, tokenizer, info = _load_or_tokenize_text(
          source, vocab_size, cache_dir, max_corpus_bytes)
    sequences = packing.cut_into_sequences(tokens, seq_len)
  total = sequences.shape[0]
  if total == 0:
    raise field_error(
        "path", f"{info.source} gives only {info.num_tokens} tokens, fewer "
        f"than one sequence of seq_len + 1 = {seq_len + 1}; give more text "
        "or lower seq_len")
  num_val = _num_validation_sequences(total, val_fraction)

  def split(name, rows):
    return PackedDataset(rows, split=name, seed=seed, vocab_size=vocab_size,
                         tokenizer=tokenizer, info=info)

  train = split("train", sequences[:total - num_val])
  if num_val:
    train.validation = split("val", sequences[total - num_val:])
  return train


def _load_or_tokenize_text(source, vocab_size, cache_dir, max_corpus_bytes,
                           given=None):
  """Tokens, tokenizer and `CorpusInfo` of a text source, through the cache.

  `given` is None (train a BPE) or (tokenizer file, its loaded tokenizer).
  """
  key = dict(files=cache.file_fingerprint(source.files), vocab_size=vocab_size,
             max_corpus_bytes=max_corpus_bytes)
  if given is not None:  # absent otherwise: trained entries keep their keys
    key["tokenizer"] = cache.file_fingerprint((given[0],), "tokenizer_path")
  entry = cache.entry_dir(cache_dir, source.kind, **key)
  (tokenizer, tokens, stats), from_cache = cache.load_or_build(
      entry, lambda folder: _tokenize_text_into(
          folder, source, vocab_size, max_corpus_bytes, given),
      lambda folder, meta: _read_text_entry(folder, meta, vocab_size))
  info = CorpusInfo(source=source.description, num_tokens=int(tokens.size),
                    tokenizer_path=os.path.join(entry, TOKENIZER_FILE),
                    tokenizer_origin=given[0] if given is not None else None,
                    from_cache=from_cache, **stats)
  return tokens, tokenizer, info


def _read_text_entry(folder, meta, vocab_size):
  """Loads a checked text entry: (tokenizer, tokens, CorpusInfo fields).

  Raises:
    ValueError, KeyError, Exception: the files or metadata do not fit
      together, or the tokenizer JSON does not parse (the cache rebuilds).
  """
  tokenizer = tokenizer_lib.load_tokenizer(os.path.join(folder,
                                                        TOKENIZER_FILE))
  # Memory-mapped: a large corpus costs page cache, not process memory.
  tokens = np.load(os.path.join(folder, TOKENS_FILE), mmap_mode="r")
  if (tokens.ndim != 1 or tokens.size != meta["num_tokens"]
      or tokens.dtype != packing.token_dtype(vocab_size)
      or tokenizer.get_vocab_size() != meta["tokenizer_vocab_size"]):
    raise ValueError(f"{TOKENS_FILE} or {TOKENIZER_FILE} does not match "
                     f"{cache.META_FILE}")
  stats = dict(num_files=meta["num_files_read"], num_docs=meta["num_docs"],
               num_text_bytes=meta["num_bytes"], truncated=meta["truncated"])
  return tokenizer, tokens, stats


def _tokenize_text_into(folder, source, vocab_size, max_corpus_bytes,
                        given=None):
  """Reads, trains a tokenizer (or copies `given`'s file), encodes; writes both
  into `folder`."""
  documents = corpus.read_documents(source.files, max_corpus_bytes)
  if not documents.texts:
    if documents.num_binary_skipped == documents.num_files_read:
      why = (f"all {documents.num_files_read} files look binary (NUL bytes)"
             "; give text files or a .bin token file")
    else:
      why = "0 bytes of text"
    raise field_error("path", f"{source.description} is empty: {why}")
  if given is not None:
    # A byte copy: the entry reads back exactly the file that was given.
    shutil.copyfile(given[0], os.path.join(folder, TOKENIZER_FILE))
    tokenizer = given[1]
  else:
    tokenizer = tokenizer_lib.train_bpe_tokenizer(documents.texts, vocab_size)
    if tokenizer.get_vocab_size() > vocab_size:
      # The trainer counts bytes and the separator within vocab_size; a larger
      # result would give ids the model's embedding cannot look up.
      raise RuntimeError(f"BPE trainer returned {tokenizer.get_vocab_size()} "
                         f"tokens for vocab_size {vocab_size}")
    tokenizer.save(os.path.join(folder, TOKENIZER_FILE))
  tokens = packing.encode_documents(
      tokenizer, documents.texts, tokenizer_lib.end_of_text_id(tokenizer),
      packing.token_dtype(vocab_size))
  np.save(os.path.join(folder, TOKENS_FILE), tokens)
  return {
      "source": source.description,
      "num_files_read": documents.num_files_read,
      "num_binary_skipped": documents.num_binary_skipped,
      "num_docs": len(documents.texts),
      "num_bytes": documents.num_bytes,
      "truncated": documents.truncated,
      "num_tokens": int(tokens.size),
      "tokenizer_vocab_size": tokenizer.get_vocab_size(),
  }


def _load_token_files(source, vocab_size, cache_dir):
  """Each shard's memmap, the token set's tokenizer (or None) and the `CorpusInfo`."""
  shards, from_cache = [], True
  for path, count in source.shards:
    tokens, cached = token_file.load_token_file(path, vocab_size, cache_dir, source.dtype,
                                                count)
    shards.append(tokens)
    from_cache &= cached
  tokenizer = None
  if source.tokenizer is not None:  # the set's copy: generation and the export decode with it
    if not os.path.isfile(source.tokenizer):
      raise field_error("path", f"{source.description} names the tokenizer "
                        f"{source.tokenizer!r}, which is missing")
    try:
      tokenizer = tokenizer_lib.load_given_tokenizer(source.tokenizer, vocab_size)
    except DataError as err:  # it names model.init_from: this tokenizer came with data.path
      field, why = str(err).split(": ", 1)
      raise field_error("path" if field == "model.init_from" else "vocab_size",
                        f"{source.description}: {why}") from None
  info = CorpusInfo(source=source.description, num_files=len(shards), num_docs=None,
                    num_tokens=sum(int(t.size) for t in shards),
                    tokenizer_path=source.tokenizer, from_cache=from_cache)
  return shards, tokenizer, info


def _shard_rows(shards, seq_len):
  """The sequences of each shard (none spans two), as one array of rows."""
  parts = [packing.cut_into_sequences(tokens, seq_len) for tokens in shards]
  return parts[0] if len(parts) == 1 else ShardedRows(parts)


def _num_validation_sequences(total: int, val_fraction: float) -> int:
  if val_fraction == 0:
    return 0
  num_val = max(1, int(total * val_fraction))
  if num_val >= total:
    raise field_error(
        "val_fraction", f"{val_fraction} of {total} sequences leaves none for "
        "training; give more text or a smaller fraction")
  return num_val


def _check_settings(vocab_size, seq_len, cache_dir, seed, max_corpus_bytes,
                    val_fraction):
  _require_int("vocab_size", vocab_size, minimum=1)
  _require_int("seq_len", seq_len, minimum=1)
  _require_int("seed", seed, minimum=0)
  if max_corpus_bytes is not None:
    _require_int("max_corpus_bytes", max_corpus_bytes, minimum=1)
  if not isinstance(cache_dir, (str, os.PathLike)) or not str(cache_dir):
    raise field_error("cache_dir", f"must be a folder path, got "
                      f"{cache_dir!r}")
  if (isinstance(val_fraction, bool)
      or not isinstance(val_fraction, (int, float, np.floating))
      or not 0 <= val_fraction < 1):
    raise field_error("val_fraction", f"must be a number in [0, 1), got "
                      f"{val_fraction!r}")


def _require_int(argument, value, minimum):
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
      or value < minimum):
    raise field_error(argument, f"must be an integer >= {minimum}, got "
                      f"{value!r}")
