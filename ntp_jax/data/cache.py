"""On-disk cache of tokenized corpora, safe for several processes at once.

An entry is a folder `<cache_dir>/data/<kind>-<key>/` whose key hashes the
input files (path, size, modification time) and the settings that change
the result. It is built in a private temporary folder and published with one
atomic rename, so a reader never sees half an entry, and when several hosts
of one job share a workdir they all end up reading the same entry.

Its `meta.json`, written last, records the size in bytes and the sha256 of
every other file of the entry, and a sha256 of its own content. Each read
checks them all (hashing in 8 MiB chunks, about 1.7 GB/s on one core), so a
truncated, edited or half-deleted entry is never used: it is moved aside,
one line naming it goes to stderr, and it is built again.
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile

import tokenizers

from ntp_jax.data.errors import DataError, field_error

# Bump when the cached layout or the tokenization recipe changes, so stale
# entries are never reused. 2: meta.json records file sizes and checksums.
CACHE_FORMAT_VERSION = 2

# Written last into an entry; its presence marks the entry complete.
META_FILE = "meta.json"

_HASH_CHUNK_BYTES = 1 << 23
# Builds tried before giving up on an entry that reads back damaged.
_MAX_BUILDS = 2


class _Damaged(Exception):
  """An entry exists but fails its checks; the message says why."""


def file_fingerprint(paths: tuple[str, ...],
                     argument: str = "path") -> list[tuple[str, int, int]]:
  """(path, size in bytes, mtime in ns) of each file, to key the cache.

  Args:
    paths: the files.
    argument: the `make_dataset` argument they come from, for errors.

  Raises:
    DataError: a file vanished or cannot be examined (naming the config
      field of `argument`, data.path by default).
  """
  fingerprint = []
  for path in paths:
    try:
      stat = os.stat(path)
    except OSError as e:
      raise field_error(argument, f"cannot read {path!r}: {e.strerror}") from None
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


def load_or_build(entry: str, write_files, read_files):
  """Reads a checked cache entry, building it first when missing or damaged.

  Args:
    entry: the entry folder (from `entry_dir`).
    write_files: callable taking a folder path, that writes the entry's
      files there and returns its JSON-serializable metadata dict.
    read_files: callable (entry folder, metadata dict) -> result, loading
      the checked files. Any exception but `DataError` it raises marks the
      entry damaged (e.g. a file the loader cannot parse).

  Returns:
    (result of `read_files`, True when the entry was already there).

  Raises:
    DataError: from `write_files` or `read_files`; or the cache folder
      cannot be written, or a freshly built entry reads back damaged
      (naming the workdir).
  """
  for builds in range(_MAX_BUILDS + 1):
    found, result = _read_entry(entry, read_files)
    if found:
      return result, builds == 0
    if builds < _MAX_BUILDS:
      build_entry(entry, write_files)
  raise field_error("cache_dir", f"data cache entry {entry} reads back "
                    "damaged after rebuilding it; check the disk holding it")


def build_entry(entry: str, write_files) -> None:
  """Builds a cache entry with `write_files` and publishes it atomically.

  Does nothing visible when another process publishes the entry first; the
  caller reads and checks whichever entry is there.

  Args:
    entry: the final entry folder (from `entry_dir`).
    write_files: see `load_or_build`.

  Raises:
    DataError: the cache folder cannot be created or written (naming the
      workdir).
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
    raise field_error("cache_dir", f"cannot create {parent!r}: {e.strerror}") from None
  try:
    info = write_files(staging)
    files = {name: _file_record(os.path.join(staging, name))
             for name in sorted(os.listdir(staging))}
    meta = {"format": CACHE_FORMAT_VERSION, "files": files, "info": info,
            "sha256": _meta_digest(files, info)}
    with open(os.path.join(staging, META_FILE), "w") as f:
      json.dump(meta, f, indent=1, sort_keys=True)
    try:
      os.rename(staging, entry)
    except OSError as e:
      # An entry there means another process published first.
      if not os.path.lexists(entry):
        raise field_error("cache_dir", f"cannot publish {entry}: "
                          f"{e.strerror}") from None
  finally:
    shutil.rmtree(staging, ignore_errors=True)


def _read_entry(entry: str, read_files) -> tuple[bool, object]:
  """(True, result) for a sound entry; (False, None) after discarding one."""
  if not os.path.lexists(entry):
    return False, None
  try:
    return True, read_files(entry, _checked_info(entry))
  except DataError:
    raise
  except _Damaged as e:
    reason = str(e)
  except Exception as e:  # pylint: disable=broad-except
    # Loaders report bad content in their own ways (tokenizers raises a bare
    # Exception); whatever it is, a rebuild replaces the entry.
    reason = f"unreadable: {type(e).__name__}: {e}"
  reason = " ".join(reason.split())
  print(f"warning: data cache entry {entry} is damaged ({reason}); "
        "rebuilding it", file=sys.stderr, flush=True)
  _discard(entry)
  return False, None


def _checked_info(entry: str) -> dict:
  """The caller's metadata of an entry whose files all pass their checks.

  Raises:
    _Damaged: metadata missing, unparsable or edited; a file missing, or of
      another size or checksum than recorded.
  """
  try:
    with open(os.path.join(entry, META_FILE), "rb") as f:
      meta = json.loads(f.read())
  except FileNotFoundError:
    raise _Damaged(f"no {META_FILE}, the entry is incomplete") from None
  except OSError as e:
    raise _Damaged(f"cannot read {META_FILE}: {e.strerror}") from None
  except ValueError:
    raise _Damaged(f"{META_FILE} is not valid JSON") from None
  if (not isinstance(meta, dict)
      or meta.get("format") != CACHE_FORMAT_VERSION
      or not isinstance(meta.get("files"), dict)
      or meta.get("sha256") != _meta_digest(meta["files"], meta.get("info"))):
    raise _Damaged(f"{META_FILE} does not match its checksum")
  for name, record in meta["files"].items():
    path = os.path.join(entry, name)
    try:
      size = os.path.getsize(path)
    except OSError:
      raise _Damaged(f"{name} is missing") from None
    if size != record["bytes"]:
      raise _Damaged(f"{name} has {size} bytes, expected {record['bytes']}")
    if _sha256(path) != record["sha256"]:
      raise _Damaged(f"{name} does not match its sha256")
  return meta["info"]


def _discard(entry: str) -> None:
  """Removes an entry, first renaming it aside so no reader sees it half."""
  try:
    trash = tempfile.mkdtemp(prefix=os.path.basename(entry) + ".damaged-",
                             dir=os.path.dirname(entry))
  except OSError:
    return  # build_entry reports the unwritable folder
  try:
    os.rename(entry, os.path.join(trash, "entry"))
  except OSError:
    pass  # already moved aside by another process
  shutil.rmtree(trash, ignore_errors=True)


def _file_record(path: str) -> dict:
  return {"bytes": os.path.getsize(path), "sha256": _sha256(path)}


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(_HASH_CHUNK_BYTES):
      digest.update(chunk)
  return digest.hexdigest()


def _meta_digest(files, info) -> str:
  blob = json.dumps({"files": files, "info": info}, sort_keys=True)
  return hashlib.sha256(blob.encode()).hexdigest()
