"""Build a token set from text files with a run's tokenizer (``token_set``).

  python -m ntp_jax.data.build_tokens CORPUS --tokenizer tokenizer.json --out tokens/ \\
      [--shard-tokens 268435456] [--dtype uint16|uint32]

``CORPUS`` is a text file, a folder (recursive) or a glob, as ``data.path``
takes text: each file is one document, followed by the tokenizer's
end-of-text token (the first of ``tokenizer.END_OF_TEXT_TOKENS`` it has), as
a run's own tokenization packs them. The ids go to ``tokens-00000.bin``,
``tokens-00001.bin``, ... (a shard closes at the first document end past
``--shard-tokens``, so no document spans two shards) in the smallest dtype
holding the tokenizer's ids: uint16 up to 65,536 ids, else uint32 (Llama 3's
128,256). The manifest ``tokens.json`` is written last, so a folder holding one
is complete; a copy of the tokenizer goes beside it. Files are read a few MB at a
time, each whole (split a corpus into files). Train with
``--config.data.path=tokens/``.

Every bad input is one line naming the argument, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import numpy as np

from ntp_jax.data import corpus
from ntp_jax.data import tokenizer as tokenizer_lib
from ntp_jax.data.dataset import TOKENIZER_FILE
from ntp_jax.data.errors import DataError
from ntp_jax.data.token_set import DTYPES, MANIFEST_FILE, TokenSet, dtype_for, write_manifest

SHARD_TOKENS = 1 << 28  # 1 GiB of uint32 ids per shard
SHARD_NAME = "tokens-{:05d}.bin"
# Characters of text encoded per call: the tokenizer's threads stay busy, memory stays small.
_BATCH_CHARS = 4_000_000


def build_token_set(inputs: str, tokenizer_path: str, out: str, *,
                    shard_tokens: int = SHARD_TOKENS, dtype: str | None = None,
                    log: Callable[[str], None] = print) -> TokenSet:
  """Encode the text files of ``inputs`` with ``tokenizer_path`` into a token set at ``out``.

  Args:
    inputs: a text file, folder or glob (``corpus.resolve_source``; not token files).
    tokenizer_path: a ``tokenizers`` JSON file (a run's ``tokenizer.json``, a Hugging
      Face folder's) with an end-of-text token.
    out: the folder to write (created; it must hold no token set or ``.bin`` files).
    shard_tokens: a shard closes at the first document end at or past this many ids.
    dtype: "uint16" or "uint32"; None: the smallest holding every id of the tokenizer.
    log: one line per shard written and one at the end.

  Returns:
    The ``TokenSet`` written (its manifest is ``out/tokens.json``).

  Raises:
    DataError: one line naming the argument: no such input or only token files there,
      an unreadable tokenizer or one without an end-of-text token, a dtype that cannot
      hold the tokenizer's ids, an ``out`` that holds a set already, a bad shard size.
  """
  if shard_tokens < 1:
    raise DataError(f"--shard-tokens: must be >= 1, got {shard_tokens}")
  try:
    source = corpus.resolve_source(inputs)
  except DataError as err:  # its message names data.path: here the input is CORPUS
    raise DataError(f"CORPUS: {str(err).split(': ', 1)[1]}") from None
  if not inputs or not isinstance(source, corpus.TextSource):
    raise DataError(f"CORPUS: {inputs!r} is not text files (give a text file, folder or "
                    "glob)")
  tokenizer = _load(tokenizer_path)
  size = _id_count(tokenizer)
  dtype = dtype or dtype_for(size)
  if dtype not in DTYPES:
    raise DataError(f"--dtype: {dtype!r}; expected one of {', '.join(DTYPES)}")
  if size > 1 << (8 * DTYPES[dtype].itemsize):
    raise DataError(f"--dtype: {dtype} holds ids below {1 << (8 * DTYPES[dtype].itemsize):,}, "
                    f"but {tokenizer_path} has {size:,} ids; use {dtype_for(size)}")
  separator = tokenizer_lib.end_of_text_id(tokenizer)
  _check_out(out)

  writer = _ShardWriter(out, DTYPES[dtype], shard_tokens, log)
  batch, chars = [], 0
  for path in source.files:
    texts = corpus.read_documents((path,), None).texts  # binary files give none
    batch += texts
    chars += sum(len(t) for t in texts)
    if chars >= _BATCH_CHARS:
      writer.add(tokenizer, batch, separator)
      batch, chars = [], 0
  writer.add(tokenizer, batch, separator)
  shards = writer.close()
  if not shards:
    raise DataError(f"CORPUS: {source.description} holds no text")
  copy = os.path.join(out, TOKENIZER_FILE)
  tokenizer_lib.copy_file(tokenizer_path, copy)
  token_set = TokenSet(dtype=dtype, shards=tuple(shards), vocab_size=size,
                       separator_id=separator, tokenizer=copy)
  write_manifest(out, token_set)
  log(f"token set {out}: {token_set.num_tokens:,} tokens of {writer.documents:,} documents in "
      f"{len(shards)} shard(s), {dtype}, separator {tokenizer.id_to_token(separator)} "
      f"(id {separator}); train with --config.data.path={out}")
  return token_set


class _ShardWriter:
  """Appends documents' ids to the current shard, a new one past ``shard_tokens``."""

  def __init__(self, out: str, dtype: np.dtype, shard_tokens: int, log):
    self.out, self.dtype, self.shard_tokens, self.log = out, dtype, shard_tokens, log
    self.shards: list[tuple[str, int]] = []
    self.file, self.count, self.in_shard, self.documents = None, 0, 0, 0

  def add(self, tokenizer, texts: list[str], separator: int) -> None:
    if not texts:
      return
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
      if self.file is None:
        path = os.path.join(self.out, SHARD_NAME.format(len(self.shards)))
        self.file, self.path, self.count, self.in_shard = open(path, "wb"), path, 0, 0
      ids = np.asarray(encoding.ids + [separator], dtype=np.int64)
      ids.astype(self.dtype).tofile(self.file)  # every id fits: checked against the vocabulary
      self.count += ids.size
      self.in_shard += 1
      self.documents += 1
      if self.count >= self.shard_tokens:
        self._end_shard()

  def _end_shard(self) -> None:
    self.file.close()
    self.file = None
    self.shards.append((self.path, self.count))
    self.log(f"  {self.path}: {self.count:,} tokens, {self.in_shard:,} documents")

  def close(self) -> list[tuple[str, int]]:
    if self.file is not None:
      self._end_shard()
    return self.shards


def _load(path: str):
  if not os.path.isfile(path):
    raise DataError(f"--tokenizer: no tokenizer file {path}")
  try:
    tokenizer = tokenizer_lib.load_tokenizer(path)
  except Exception as e:  # tokenizers raises bare Exception
    raise DataError(f"--tokenizer: cannot read {path} as a tokenizers JSON file "
                    f"({type(e).__name__}: {e})") from None
  vocab = tokenizer.get_vocab(with_added_tokens=True)
  if not any(token in vocab for token in tokenizer_lib.END_OF_TEXT_TOKENS):
    raise DataError(f"--tokenizer: {path} has none of the end-of-text tokens "
                    f"{', '.join(tokenizer_lib.END_OF_TEXT_TOKENS)} to separate documents with")
  return tokenizer


def _id_count(tokenizer) -> int:
  """Ids the tokenizer can give: its size, or past its largest id when that is larger."""
  vocab = tokenizer.get_vocab(with_added_tokens=True)
  return max(tokenizer.get_vocab_size(with_added_tokens=True),
             max(vocab.values(), default=-1) + 1)


def _check_out(out: str) -> None:
  if os.path.exists(out) and not os.path.isdir(out):
    raise DataError(f"--out: {out} is a file, not a folder")
  if os.path.isdir(out) and (os.path.exists(os.path.join(out, MANIFEST_FILE))
                             or any(n.endswith(".bin") for n in os.listdir(out))):
    raise DataError(f"--out: {out} already holds a token set or .bin files; give a new folder")
  try:
    os.makedirs(out, exist_ok=True)
  except OSError as e:
    raise DataError(f"--out: cannot create {out}: {e.strerror}") from None


def main(argv: list[str] | None = None) -> int:
  """The command line; returns the exit status (0, or 2 after a one-line error)."""
  parser = argparse.ArgumentParser(
      prog="python -m ntp_jax.data.build_tokens",
      description="Encode text files with a tokenizer into a token set (.bin shards and "
                  "their manifest, uint32 for vocabularies past 65,536) for data.path.")
  parser.add_argument("corpus", metavar="CORPUS", help="a text file, folder or glob")
  parser.add_argument("--tokenizer", required=True,
                      help="a tokenizers JSON file: the run's tokenizer.json")
  parser.add_argument("--out", required=True, help="the folder to write (new or empty)")
  parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS,
                      help=f"ids per shard, at a document end (default {SHARD_TOKENS:,})")
  parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                      help="default: uint16 when the tokenizer has at most 65,536 ids, "
                           "else uint32")
  args = parser.parse_args(argv)
  try:
    build_token_set(args.corpus, args.tokenizer, args.out, shard_tokens=args.shard_tokens,
                    dtype=args.dtype)
  except DataError as err:
    print(f"build_tokens: {err}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
