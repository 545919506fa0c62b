"""Pre-tokenized `.bin` token files, as nanoGPT-style prepare scripts write.

The format is a bare array of little-endian uint16 token ids with no header;
documents are already joined with their separator by whoever wrote it. The
file is memory-mapped, so corpora larger than RAM work.
"""

import numpy as np

from ntp_jax.data import cache
from ntp_jax.data.errors import field_error

TOKEN_DTYPE = np.dtype("<u2")

# Tokens scanned per step when checking the largest id: bounded memory.
_SCAN_CHUNK_TOKENS = 1 << 26


def load_token_file(path: str, vocab_size: int,
                    cache_dir: str) -> tuple[np.ndarray, bool]:
  """Memory-maps a `.bin` token file and checks every id fits the model.

  The largest id is found by a full scan once and cached (keyed by the
  file's size and modification time, checked on read and rescanned with a
  warning when damaged), so restarts on big files are quick.

  Args:
    path: absolute path of the `.bin` file.
    vocab_size: model vocabulary; every token id must be below it.
    cache_dir: workdir holding the cached scan.

  Returns:
    (tokens, from_cache): a read-only uint16 memmap of shape [num_tokens],
    and whether the scan result came from the cache.

  Raises:
    DataError: the file is empty, has an odd byte count, cannot be read, or
      holds a token id >= vocab_size (all naming data.path).
  """
  ((_, size, mtime_ns),) = cache.file_fingerprint((path,))
  if size == 0:
    raise field_error("path", f"token file {path!r} is empty")
  if size % TOKEN_DTYPE.itemsize:
    raise field_error(
        "path", f"token file {path!r} has {size} bytes, not a whole number "
        "of uint16 tokens; a .bin file must be raw little-endian uint16")
  try:
    tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")
  except OSError as e:
    raise field_error("path", f"cannot read {path!r}: {e.strerror}") from None

  entry = cache.entry_dir(cache_dir, "bin", file=(path, size, mtime_ns))
  max_token, from_cache = cache.load_or_build(
      entry, lambda _: {"max_token": _max_token(tokens),
                        "num_tokens": int(tokens.size)},
      lambda _, meta: _cached_max_token(meta, tokens.size))
  if max_token >= vocab_size:
    raise field_error(
        "vocab_size", f"{vocab_size}, but token file {path!r} (data.path) "
        f"holds token id {max_token}; set model.vocab_size above {max_token} "
        "or re-tokenize")
  return tokens, from_cache


def _cached_max_token(meta: dict, num_tokens: int) -> int:
  """The scan result of a checked entry; raises ValueError if it is off."""
  max_token = meta["max_token"]
  if (meta["num_tokens"] != num_tokens or not isinstance(max_token, int)
      or not 0 <= max_token < 1 << 16):
    raise ValueError("the cached scan does not fit the token file")
  return max_token


def _max_token(tokens: np.ndarray) -> int:
  largest = 0
  for start in range(0, tokens.size, _SCAN_CHUNK_TOKENS):
    largest = max(largest, int(tokens[start:start + _SCAN_CHUNK_TOKENS].max()))
  return largest
