"""A token set: `.bin` shards of one dtype and the manifest that describes them.

A plain `.bin` file (nanoGPT's format) has no header and is read as
little-endian uint16. A vocabulary past 65,536 ids (Llama 3's 128,256) needs
uint32, which the bytes alone cannot tell; so a token set is a folder holding

  tokens.json          the manifest (below)
  tokens-00000.bin     raw little-endian ids, documents each followed by the separator
  tokens-00001.bin     ...
  tokenizer.json       a copy of the tokenizer the ids come from (optional)

with the manifest

  {"format": "ntp_jax.tokens", "version": 1, "dtype": "uint32",
   "vocab_size": 128256, "separator_id": 128001, "tokenizer": "tokenizer.json",
   "shards": [{"file": "tokens-00000.bin", "num_tokens": 268435571}, ...]}

The shards stay raw arrays, so `np.memmap(file, dtype="<u4")` reads one
anywhere. `python -m ntp_jax.data.build_tokens` writes a set
(`ntp_jax.data.build_tokens`); `data.path` takes the folder, its manifest, or
one of its shards (then read with the manifest's dtype).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from ntp_jax.data.errors import field_error

MANIFEST_FILE = "tokens.json"
FORMAT = "ntp_jax.tokens"
VERSION = 1
# dtype name in the manifest -> the little-endian numpy dtype of the shards.
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
PLAIN_DTYPE = "uint16"  # a .bin file outside a token set


@dataclasses.dataclass(frozen=True)
class TokenSet:
  """A token set's manifest, its paths made absolute.

  Attributes:
    dtype: "uint16" or "uint32" (little-endian).
    shards: (absolute path, token count) of each shard, in stream order.
    vocab_size: the tokenizer's ids are below it.
    separator_id: the id after each document, or None when not recorded.
    tokenizer: absolute path of the tokenizer copy, or None.
  """

  dtype: str
  shards: tuple[tuple[str, int], ...]
  vocab_size: int
  separator_id: int | None = None
  tokenizer: str | None = None

  @property
  def num_tokens(self) -> int:
    return sum(count for _, count in self.shards)


def dtype_for(vocab_size: int) -> str:
  """The smallest dtype name holding every id below ``vocab_size``."""
  return "uint16" if vocab_size <= 1 << 16 else "uint32"


def read_manifest(path: str) -> TokenSet:
  """The token set whose manifest is ``path``.

  Raises:
    DataError: naming data.path: the file cannot be read or parsed, is not a token-set
      manifest, or names a dtype, shard or count that does not fit (one line).
  """
  def bad(why: str):
    return field_error("path", f"token-set manifest {path!r}: {why}")

  try:
    with open(path, encoding="utf-8") as f:
      meta = json.load(f)
  except OSError as e:
    raise bad(f"cannot read it: {e.strerror}") from None
  except ValueError as e:
    raise bad(f"not JSON ({e})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise bad(f"not a token-set manifest (no \"format\": \"{FORMAT}\")")
  if meta.get("version") != VERSION:
    raise bad(f"version {meta.get('version')!r}; this reader reads version {VERSION}")
  if meta.get("dtype") not in DTYPES:
    raise bad(f"dtype {meta.get('dtype')!r}; expected one of {', '.join(DTYPES)}")
  vocab_size = meta.get("vocab_size")
  if not _whole(vocab_size) or vocab_size < 1:
    raise bad(f"vocab_size {vocab_size!r}; expected a whole number >= 1")
  if vocab_size > 1 << (8 * DTYPES[meta["dtype"]].itemsize):
    raise bad(f"vocab_size {vocab_size:,} does not fit {meta['dtype']}")
  shards = meta.get("shards")
  if not isinstance(shards, list) or not shards:
    raise bad("no shards")
  folder = os.path.dirname(os.path.abspath(path))
  listed = []
  for shard in shards:
    name = shard.get("file") if isinstance(shard, dict) else None
    count = shard.get("num_tokens") if isinstance(shard, dict) else None
    if not isinstance(name, str) or os.path.basename(name) != name or not _whole(count):
      raise bad(f"shard {shard!r}; expected {{\"file\": NAME in the folder, "
                "\"num_tokens\": COUNT}")
    listed.append((os.path.join(folder, name), count))
  separator = meta.get("separator_id")
  tokenizer = meta.get("tokenizer")
  return TokenSet(dtype=meta["dtype"], shards=tuple(listed), vocab_size=vocab_size,
                  separator_id=separator if _whole(separator) else None,
                  tokenizer=(os.path.join(folder, tokenizer) if isinstance(tokenizer, str)
                             else None))


def manifest_in(folder: str) -> str | None:
  """The manifest of the token set in ``folder``, or None when it holds none."""
  path = os.path.join(folder, MANIFEST_FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      return path if json.load(f).get("format") == FORMAT else None
  except (OSError, ValueError, AttributeError):
    return None  # some other tokens.json, in a folder of text: not ours


def set_of_shard(path: str) -> TokenSet | None:
  """The token set listing the `.bin` file ``path`` as a shard, or None (a plain file).

  Raises:
    DataError: the manifest beside it is broken (see ``read_manifest``).
  """
  manifest = manifest_in(os.path.dirname(path))
  if manifest is None:
    return None
  token_set = read_manifest(manifest)
  mine = [shard for shard in token_set.shards if shard[0] == path]
  return dataclasses.replace(token_set, shards=tuple(mine)) if mine else None


def write_manifest(folder: str, token_set: TokenSet) -> str:
  """Writes ``folder``'s manifest (shard and tokenizer names relative to it), whole: a
  temporary name, then one rename, so a folder with a manifest is a complete set."""
  meta = {"format": FORMAT, "version": VERSION, "dtype": token_set.dtype,
          "vocab_size": token_set.vocab_size, "separator_id": token_set.separator_id,
          "tokenizer": (os.path.basename(token_set.tokenizer) if token_set.tokenizer
                        else None),
          "shards": [{"file": os.path.basename(p), "num_tokens": n}
                     for p, n in token_set.shards]}
  path = os.path.join(folder, MANIFEST_FILE)
  with open(f"{path}.partial", "w", encoding="utf-8") as f:
    json.dump(meta, f, indent=1)
    f.write("\n")
  os.replace(f"{path}.partial", path)
  return path


def _whole(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0
