"""Where the training text comes from, and reading it into documents.

`data.path` is resolved here into one of two sources:

* a `TextSource`: a list of text files, each one document. With no path this
  is the running interpreter's standard-library source (every Python install
  ships it, so training works offline with no data set). Otherwise the user's
  file, folder (recursive) or glob pattern.
* a `TokenFileSource`: pre-tokenized ids. A plain `.bin` file of little-endian
  uint16 tokens, the format nanoGPT-style prepare scripts write; or a token set
  (`token_set`: `.bin` shards with a manifest naming their dtype, uint32 for
  large vocabularies), given as its folder, its manifest or one of its shards.

Standard-library corpus choices: only `*.py` files; `site-packages` and
`dist-packages` are skipped (installed third-party code, differs between
machines), and so are `test`, `tests` and `idle_test` directories: CPython's
test suite is larger than the rest of the library together and holds
deliberately malformed sources and odd encodings, which would crowd ordinary
library code out of the byte budget.
"""

import dataclasses
import glob
import os
import sysconfig

from ntp_jax.data import token_set
from ntp_jax.data.errors import field_error

TOKEN_FILE_SUFFIX = ".bin"

# Directory names never descended into when collecting the stdlib corpus.
STDLIB_SKIPPED_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test",
    "__pycache__",
})

# A NUL byte in the first block marks a file as binary, the check `grep` and
# `git` use; real text in any common encoding but UTF-16/32 has none.
_BINARY_SNIFF_BYTES = 8192
_GLOB_CHARS = frozenset("*?[")


@dataclasses.dataclass(frozen=True)
class TextSource:
  """Text files to tokenize, in the (sorted, deterministic) order to read.

  Attributes:
    kind: "stdlib" for the interpreter's library, "text" for user files.
    description: human-readable origin, for logs.
    files: absolute file paths, sorted.
  """
  kind: str
  description: str
  files: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TokenFileSource:
  """Pre-tokenized ids: one plain `.bin` file, or (shards of) a token set.

  Attributes:
    description: human-readable origin, for logs.
    shards: (absolute path, token count from the manifest or None) of each file, in
      stream order.
    dtype: "uint16" (a plain `.bin` file) or the token set's dtype.
    tokenizer: the token set's tokenizer copy, or None.
  """
  description: str
  shards: tuple[tuple[str, int | None], ...]
  dtype: str = token_set.PLAIN_DTYPE
  tokenizer: str | None = None
  kind: str = "bin"


def _token_file(path: str) -> TokenFileSource:
  """A `.bin` file: read with its token set's dtype when a manifest beside it lists it."""
  listed = token_set.set_of_shard(path)
  if listed is None:
    return TokenFileSource(f"token file {path!r}", ((path, None),))
  return TokenFileSource(f"token file {path!r} ({listed.dtype}, of the token set beside it)",
                         listed.shards, listed.dtype, listed.tokenizer)


def _token_set(manifest: str) -> TokenFileSource:
  listed = token_set.read_manifest(manifest)
  return TokenFileSource(
      f"token set {os.path.dirname(manifest)!r} ({len(listed.shards)} shard(s), "
      f"{listed.dtype})", listed.shards, listed.dtype, listed.tokenizer)


@dataclasses.dataclass(frozen=True)
class Documents:
  """The text read from a `TextSource`, one string per non-empty file.

  Attributes:
    texts: document texts, in file order; empty files are left out.
    num_files_read: files opened before the byte budget ran out.
    num_binary_skipped: files skipped because they hold NUL bytes.
    num_bytes: bytes of text kept, counted before UTF-8 decoding.
    truncated: True when the byte budget cut the corpus short.
  """
  texts: list[str]
  num_files_read: int
  num_binary_skipped: int
  num_bytes: int
  truncated: bool


def resolve_source(path: str | None) -> TextSource | TokenFileSource:
  """Turns the `data.path` setting into a concrete data source.

  Args:
    path: None or "" for the standard-library corpus; otherwise a text file,
      a folder (searched recursively), a glob pattern (`**` allowed), a
      single `.bin` uint16 token file (directly or as the only glob match), or a
      token set (its folder or manifest; a shard of one is read with its dtype).

  Returns:
    The `TextSource` or `TokenFileSource` to read.

  Raises:
    DataError: the path does not exist, the glob matches nothing, the folder
      holds no files, or `.bin` token files are mixed with other files.
  """
  if not path:
    return stdlib_source()
  expanded = os.path.abspath(os.path.expanduser(path))
  if os.path.isfile(expanded):
    if expanded.endswith(TOKEN_FILE_SUFFIX):
      return _token_file(expanded)
    if os.path.basename(expanded) == token_set.MANIFEST_FILE and token_set.manifest_in(
        os.path.dirname(expanded)):
      return _token_set(expanded)
    return TextSource("text", f"text file {expanded!r}", (expanded,))
  if os.path.isdir(expanded):
    manifest = token_set.manifest_in(expanded)
    if manifest is not None:
      return _token_set(manifest)
    files = _files_under(expanded, skip_dir=_is_hidden)
    if not files:
      raise field_error("path", f"folder {path!r} holds no files")
    return TextSource("text", f"text folder {expanded!r}", tuple(files))
  if not _GLOB_CHARS.intersection(path):
    raise field_error("path", f"no such file or folder: {path!r}")

  matches = sorted(glob.glob(os.path.expanduser(path), recursive=True))
  if not matches:
    raise field_error("path", f"no file matches {path!r}")
  token_files = [m for m in matches if m.endswith(TOKEN_FILE_SUFFIX)
                 and os.path.isfile(m)]
  if token_files:
    if len(matches) == 1:
      return _token_file(os.path.abspath(token_files[0]))
    raise field_error(
        "path", f"{path!r} matches {len(matches)} paths including .bin token "
        "files; give exactly one .bin file, the folder of a token set (python -m "
        "ntp_jax.data.build_tokens), or text files only")
  files = []
  for match in matches:
    match = os.path.abspath(match)
    if os.path.isdir(match):
      files.extend(_files_under(match, skip_dir=_is_hidden))
    elif os.path.isfile(match):
      files.append(match)
  # Matches may overlap (a folder and a file inside it); keep each file once.
  files = sorted(set(files))
  if not files:
    raise field_error("path", f"{path!r} matches only empty folders")
  return TextSource("text", f"text files {path!r}", tuple(files))


def stdlib_source() -> TextSource:
  """The `*.py` files of the running interpreter's standard library.

  Returns:
    A `TextSource` of kind "stdlib", files sorted by path below the stdlib
    root (see the module docstring for the directories skipped).

  Raises:
    DataError: the standard library has no `.py` sources here (e.g. an
      embedded interpreter with a zipped library).
  """
  root = os.path.abspath(sysconfig.get_paths()["stdlib"])
  files = [
      f for f in _files_under(
          root, skip_dir=lambda name: name in STDLIB_SKIPPED_DIRS
          or _is_hidden(name))
      if f.endswith(".py")
  ]
  if not files:
    raise field_error(
        "path", f"no data path given and the standard library at {root!r} "
        "has no .py sources; set data.path to text files or a .bin file")
  return TextSource("stdlib", f"stdlib corpus {root!r}", tuple(files))


def read_documents(files: tuple[str, ...],
                   max_bytes: int | None) -> Documents:
  """Reads text files in order until `max_bytes` bytes of text are kept.

  Each file is decoded as UTF-8 with invalid bytes replaced by U+FFFD, so
  reading never fails on content. Files with a NUL byte in their first 8 kB
  are skipped as binary (this includes UTF-16 text). The file that crosses
  the budget is cut at the byte limit.

  Args:
    files: paths to read, in order.
    max_bytes: byte budget for the whole corpus; None reads everything.

  Returns:
    The `Documents` read.

  Raises:
    DataError: a file cannot be read (naming data.path).
  """
  texts = []
  num_bytes = num_files_read = num_binary_skipped = 0
  truncated = False
  for file_path in files:
    if max_bytes is not None and num_bytes >= max_bytes:
      truncated = True
      break
    num_files_read += 1
    try:
      with open(file_path, "rb") as f:
        head = f.read(_BINARY_SNIFF_BYTES)
        if b"\0" in head:
          num_binary_skipped += 1
          continue
        if max_bytes is None:
          data = head + f.read()
        else:
          remaining = max_bytes - num_bytes
          # One byte past the budget tells a file that ends exactly at the
          # budget from one that is cut.
          data = head + f.read(max(0, remaining + 1 - len(head)))
          if len(data) > remaining:
            data = data[:remaining]
            truncated = True
    except OSError as e:
      raise field_error("path", f"cannot read {file_path!r}: {e.strerror}") from None
    num_bytes += len(data)
    if data:
      texts.append(data.decode("utf-8", errors="replace"))
  return Documents(texts, num_files_read, num_binary_skipped, num_bytes,
                   truncated)


def _is_hidden(name: str) -> bool:
  return name.startswith(".")


def _files_under(root: str, skip_dir) -> list[str]:
  """All regular files below `root`, sorted, not entering skipped dirs."""
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not skip_dir(d))
    for name in filenames:
      if _is_hidden(name):
        continue
      full = os.path.join(dirpath, name)
      if os.path.isfile(full):
        found.append(full)
  # Sort on the final list: os.walk yields a folder's files before the files
  # of its subfolders, which is not plain path order.
  return sorted(found)
