"""Compilation as the trainer sees it: the persistent cache, and seconds spent compiling.

- ``set_up_cache``: JAX's persistent compilation cache in a folder
  (``compile.cache_dir``, default ``WORKDIR/compile_cache``). A restart in a
  new process loads its programs from there instead of compiling them. On
  GPU the cache key leaves out the device assignment
  (``jax/_src/cache_key.py``), so one compiled class program serves every
  device set of the same layouts; on CPU the devices are part of the key.
- ``compile_seconds``: seconds the calling thread has spent lowering and
  compiling (``jax.monitoring`` events), so the loop can say
  what a recovery spent compiling on its critical path while a background
  thread compiles other plans (``ntp_jax.training.precompile``).
- ``compile_counts``: programs the calling thread has had XLA compile, and
  those it loaded from the persistent cache instead, so a step can say which
  it did (a restart should load every program the previous session compiled).
"""

from __future__ import annotations

import collections
import os
import threading

import jax
from jax.experimental.compilation_cache import compilation_cache

from ntp_jax.errors import ConfigError

# jax.monitoring events of one compilation: lowering to MLIR, then the XLA compile (or a
# persistent-cache load). Tracing is left out: shape inference (jax.eval_shape) traces too.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")

# One per program that goes to XLA: its compile, or its load from the persistent cache.
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # ... the load

_seconds: collections.Counter = collections.Counter()  # thread id -> seconds compiling
_requests: collections.Counter = collections.Counter()  # thread id -> programs sent to XLA
_hits: collections.Counter = collections.Counter()  # thread id -> of those, loaded
_listening = False
_lock = threading.Lock()


def _listen(event: str, duration: float, **_) -> None:
  if event in COMPILE_EVENTS:
    _seconds[threading.get_ident()] += duration
  if event == BACKEND_COMPILE_EVENT:
    _requests[threading.get_ident()] += 1


def _listen_hits(event: str, **_) -> None:
  if event == CACHE_HIT_EVENT:
    _hits[threading.get_ident()] += 1


def _start_listening() -> None:
  global _listening
  with _lock:
    if not _listening:  # one listener per process: jax.monitoring has no public unregister
      jax.monitoring.register_event_duration_secs_listener(_listen)
      jax.monitoring.register_event_listener(_listen_hits)
      _listening = True


def compile_seconds() -> float:
  """Seconds the calling thread has spent compiling since the first call (take differences)."""
  _start_listening()
  return _seconds[threading.get_ident()]


def compile_counts() -> tuple[int, int]:
  """``(compiled, loaded)``: programs the calling thread has had XLA compile, and those it
  loaded from the persistent compilation cache, since the first call (take differences)."""
  _start_listening()
  me = threading.get_ident()
  return _requests[me] - _hits[me], _hits[me]


_chosen: str | None = None  # the folder set_up_cache chose (not the environment's)


def make_folder(path: str, field: str) -> None:
  """Create the folder ``path`` (and its parents) if missing.

  Raises:
    ConfigError: it cannot be a folder (a file is there, no permission, ...), naming
      ``field`` (the config field that gave it).
  """
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as err:
    raise ConfigError(f"{field}: {path} cannot be a folder ({err.strerror})") from None


def set_up_cache(setting: str, workdir: str) -> str | None:
  """Point JAX's persistent compilation cache where ``compile.cache_dir`` says; returns the
  folder, or None when off.

  ``setting``: a folder; ``""``: JAX's own setting when the environment
  gives one (``JAX_COMPILATION_CACHE_DIR``), else ``WORKDIR/compile_cache``;
  ``"none"``: off. In a folder chosen here every program is cached, however
  quick its compile, so a restart loads all of them. A later call may move
  the process's cache to another folder.

  Raises:
    ConfigError: the folder cannot be created, naming ``compile.cache_dir`` or ``workdir``.
  """
  global _chosen
  current = jax.config.jax_compilation_cache_dir
  environment = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if setting == "none":
    folder = None
  elif setting:
    folder = setting
  elif environment:  # the environment's own cache, with its own thresholds
    folder = environment
  elif current and current != _chosen:  # the caller's own cache (set in Python)
    return current
  else:
    folder = os.path.join(workdir, "compile_cache")
  if folder != current:
    compilation_cache.reset_cache()  # the cache object keeps the folder it first opened
    jax.config.update("jax_compilation_cache_dir", folder)
  _chosen = folder
  if folder is not None and folder != environment:
    make_folder(folder, "compile.cache_dir" if setting else "workdir")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return folder


def host_resident_bytes() -> int:
  """This process's resident host memory in bytes (0 where ``/proc`` is missing)."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return 0
