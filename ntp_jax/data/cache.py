"""On-disk cache of tokenized corpora, safe for several processes at once.

An entry is a folder `<cache_dir>/data/<kind>-<key>/` whose key hashes the
input files (path, size, modification time) and the settings that change
the result. It is built in a private temporary folder and published with one
atomic rename, so a reader never sees half an entry, and when several hosts
of one job share a workdir they all end up reading the same entry.
"""

import hashlib
import json
import os
import shutil
import tempfile

import tokenizers

from ntp_jax.data.errors import field_error

# Bump when the cached layout or the tokenization recipe changes, so stale
# entries are never reused.
CACHE_FORMAT_VERSION = 1

# Written last into an entry; its presence marks the entry complete.
META_FILE = "meta.json"


def file_fingerprint(paths: tuple[str, ...]) -> list[tuple[str, int, int]]:
  """(path, size in bytes, mtime in ns) of each file, to key the cache.

  Raises:
    DataError: a file vanished or cannot be examined (naming data.path).
  """
  fingerprint = []
  for path in paths:
    try:
      stat = os.stat(path)
    except OSError as e:
      raise field_error("path", f"cannot read {path!r}: {e.strerror}")
    fingerprint.append((path, stat.st_size, stat.st_mtime_ns))
  return fingerprint


def entry_dir(cache_dir: str, kind: str, **key_parts) -> str:
  """The cache folder for a data source and its settings.

  Args:
    cache_dir: the run's workdir.
    kind: source kind ("stdlib", "text", "bin"), a readable prefix.
    **key_parts: JSON-serializable values that determine the entry's content.

  Returns:
    `<cache_dir>/data/<kind>-<16 hex digits>`; not created here.
  """
  blob = json.dumps(
      {"format": CACHE_FORMAT_VERSION, "tokenizers": tokenizers.__version__,
       "kind": kind, **key_parts}, sort_keys=True)
  digest = hashlib.sha256(blob.encode()).hexdigest()[:16]
  return os.path.join(cache_dir, "data", f"{kind}-{digest}")


def read_meta(entry: str) -> dict | None:
  """The metadata of a complete entry, or None when there is none yet."""
  try:
    with open(os.path.join(entry, META_FILE)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def build_entry(entry: str, write_files) -> None:
  """Builds a cache entry with `write_files` and publishes it atomically.

  Args:
    entry: the final entry folder (from `entry_dir`).
    write_files: callable taking a folder path, that writes the entry's
      files there and returns its JSON-serializable metadata dict.

  Raises:
    DataError: the cache folder cannot be created (naming the workdir).
  """
  parent = os.path.dirname(entry)
  try:
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=os.path.basename(entry) + ".tmp-",
                               dir=parent)
    # mkdtemp makes the folder private (0700); the published entry should
    # read like any other file the run writes.
    os.chmod(staging, 0o755)
  except OSError as e:
    raise field_error("cache_dir", f"cannot create {parent!r}: {e.strerror}")
  try:
    meta = write_files(staging)
    with open(os.path.join(staging, META_FILE), "w") as f:
      json.dump(meta, f, indent=1, sort_keys=True)
    if os.path.isdir(entry) and read_meta(entry) is None:
      # A folder without metadata is no complete entry (e.g. half deleted by
      # hand); rename cannot replace a non-empty folder, so clear it first.
      shutil.rmtree(entry, ignore_errors=True)
    try:
      os.rename(staging, entry)
    except OSError:
      # Another process published the same entry first; theirs is as good.
      if read_meta(entry) is None:
        raise
  finally:
    shutil.rmtree(staging, ignore_errors=True)
