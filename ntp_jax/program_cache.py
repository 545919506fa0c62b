"""The compiled programs of a run, each made once: ``ProgramCache``.

Each compiled operation of training (class steps, the cross-class sync, the state
moves of a placement or a recovery) is one ``jax.jit`` object, or a small class
holding them (``steps.FusedStep``, ``placement.Placement``, ...), written once. The
run calls it with arrays; compiling ahead (``ntp_jax.training.precompile``) lowers
the very same object from ``jax.ShapeDtypeStruct``s with shardings and compiles
it, and JAX keeps the executable with that object, so the later call compiles
nothing. The objects live in the ``ProgramCache`` the caller passes down
(``training.loop.TrainingRun`` owns one per run); a caller that passes none gets a
fresh one, and nothing outlives the cache (no module-level cache of programs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import jax


class Lowerable(Protocol):
  """An operation that knows its own abstract inputs: ``lower()`` lowers each program it
  runs for them (``jax.stages.Lowered``, compiled with ``.compile()``)."""

  def lower(self) -> list[jax.stages.Lowered]:
    ...


class ProgramCache:
  """Programs by what they are compiled from: class steps, cross-class syncs, state moves.

  A plan met again (a repaired replica back at its old layout, a second
  failure that gives a layout seen before) reuses the programs, whose
  executables JAX keeps: it compiles nothing. ``events`` records each lookup
  of a class step or sync as ``(description, hit)``; ``compiled`` holds the
  keys whose programs have been compiled (by a first call, or ahead of time),
  so a hit on an entry made ahead but not yet compiled is told apart. Safe to
  use from a background compiling thread and the training loop at once.
  """

  def __init__(self):
    self._entries: dict[Any, Any] = {}
    self._lock = threading.RLock()  # a ``make`` may look up another entry
    self.events: list[tuple[str, bool]] = []
    self.compiled: set[Hashable] = set()

  def get(self, key: Hashable, what: str, make: Callable[[], Any], *,
          record: bool = True) -> Any:
    """The entry of ``key``, made by ``make()`` on a miss; ``record=False`` leaves
    ``events`` alone (a lookup made ahead of time).

    Raises:
      TypeError: ``key`` is not hashable.
    """
    with self._lock:
      hit = key in self._entries
      if not hit:
        self._entries[key] = make()
      if record:
        self.events.append((what, hit))
      return self._entries[key]

  def program(self, key: Hashable, make: Callable[[], Any]) -> Any:
    """The jitted program (or object holding programs) of ``key``, made by ``make()`` once;
    not an event (``events`` counts class steps and syncs)."""
    return self.get(key, "", make, record=False)

  def mark_compiled(self, keys) -> None:
    with self._lock:
      self.compiled.update(keys)

  def compiled_keys(self) -> set[Hashable]:
    """A copy of ``compiled``, taken under the lock (another thread may be adding)."""
    with self._lock:
      return set(self.compiled)

  @property
  def hits(self) -> int:
    return sum(hit for _, hit in self.events)

  @property
  def misses(self) -> int:
    return sum(not hit for _, hit in self.events)


def abstract(tree: Any) -> Any:
  """Every array of ``tree`` as a ``jax.ShapeDtypeStruct`` with its shape, dtype and
  sharding (what lowering reads of it; a buffer donated since is not touched)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      tree)
