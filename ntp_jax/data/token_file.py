"""Pre-tokenized `.bin` token files: nanoGPT's plain uint16 files and token-set shards.

A plain file is a bare array of little-endian uint16 token ids with no header;
a shard of a token set (`token_set`) holds ids of the dtype its manifest names
(uint32 for vocabularies past 65,536). Documents are already joined with their
separator by whoever wrote the file. The file is memory-mapped, so corpora
larger than RAM work.
"""

import numpy as np

from ntp_jax.data import cache
from ntp_jax.data.errors import field_error
from ntp_jax.data.token_set import DTYPES, PLAIN_DTYPE

# Tokens scanned per step when checking the largest id: bounded memory.
_SCAN_CHUNK_TOKENS = 1 << 26


def load_token_file(path: str, vocab_size: int, cache_dir: str, dtype: str = PLAIN_DTYPE,
                    num_tokens: int | None = None) -> tuple[np.ndarray, bool]:
  """Memory-maps a `.bin` token file and checks every id fits the model.

  The largest id is found by a full scan once and cached (keyed by the
  file's size, modification time and dtype, checked on read and rescanned
  with a warning when damaged), so restarts on big files are quick.

  Args:
    path: absolute path of the `.bin` file.
    vocab_size: model vocabulary; every token id must be below it.
    cache_dir: workdir holding the cached scan.
    dtype: "uint16" (a plain file) or "uint32", little-endian (a token set's).
    num_tokens: the count its token set's manifest records, or None.

  Returns:
    (tokens, from_cache): a read-only memmap of ``dtype``, shape [num_tokens],
    and whether the scan result came from the cache.

  Raises:
    DataError: the file is empty, is not a whole number of ``dtype`` ids, holds another
      count than its manifest says, cannot be read, or holds a token id >= vocab_size
      (all one line naming data.path or model.vocab_size).
  """
  np_dtype = DTYPES[dtype]
  ((_, size, mtime_ns),) = cache.file_fingerprint((path,))
  if size == 0:
    raise field_error("path", f"token file {path!r} is empty")
  if size % np_dtype.itemsize:
    plain = "; a .bin file must be raw little-endian uint16" if dtype == PLAIN_DTYPE else ""
    raise field_error(
        "path", f"token file {path!r} has {size} bytes, not a whole number "
        f"of {dtype} tokens{plain}")
  if num_tokens is not None and size // np_dtype.itemsize != num_tokens:
    raise field_error(
        "path", f"token file {path!r} holds {size // np_dtype.itemsize:,} {dtype} tokens, "
        f"its token set's manifest says {num_tokens:,}; rebuild the set")
  try:
    tokens = np.memmap(path, dtype=np_dtype, mode="r")
  except OSError as e:
    raise field_error("path", f"cannot read {path!r}: {e.strerror}") from None

  # A plain file's key is as before (its entries stay valid); a set's shard adds its dtype.
  key = dict(file=(path, size, mtime_ns), **({} if dtype == PLAIN_DTYPE else {"dtype": dtype}))
  entry = cache.entry_dir(cache_dir, "bin", **key)
  max_token, from_cache = cache.load_or_build(
      entry, lambda _: {"max_token": _max_token(tokens),
                        "num_tokens": int(tokens.size)},
      lambda _, meta: _cached_max_token(meta, tokens.size, np_dtype))
  if max_token >= vocab_size:
    raise field_error(
        "vocab_size", f"{vocab_size}, but token file {path!r} (data.path) "
        f"holds token id {max_token}; set model.vocab_size above {max_token} "
        "or re-tokenize")
  return tokens, from_cache


def _cached_max_token(meta: dict, num_tokens: int, dtype: np.dtype) -> int:
  """The scan result of a checked entry; raises ValueError if it is off."""
  max_token = meta["max_token"]
  if (meta["num_tokens"] != num_tokens or not isinstance(max_token, int)
      or not 0 <= max_token < 1 << (8 * dtype.itemsize)):
    raise ValueError("the cached scan does not fit the token file")
  return max_token


def _max_token(tokens: np.ndarray) -> int:
  largest = 0
  for start in range(0, tokens.size, _SCAN_CHUNK_TOKENS):
    largest = max(largest, int(tokens[start:start + _SCAN_CHUNK_TOKENS].max()))
  return largest
