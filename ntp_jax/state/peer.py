"""Live recovery: the new plan's state from the live DP peers of the old one.

A failure (or repair) changes the set of failed ``(replica, slot)`` pairs;
the planner makes the new plan (``ntp_jax.parallel.plan.make_plan``), and the new
class programs are filled through ``placement.place_logical`` from a
``PeerSource``: the live state of the old programs. Every replica holds
identical state, so each logical element is taken from a live device that holds
it (the device itself when it does, ``peer_move``); the failed device is never
read (``poison`` overwrites its buffers with NaN first, so a wrong read would show
in the loss). Only the shard units whose device changes move, device to device;
no array passes through the host. Source: Arfeen et al., arXiv:2504.06095,
Sec. 3-4 (reduced TP degree after a failure); the live reshard from DP peers is
our own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ntp_jax.program_cache import ProgramCache
from ntp_jax.state.peer_move import ClassMove, PeerMove
from ntp_jax.state.placement import BaseSource, Leaf, Path, leaves_of, per_device


def poison(programs: list, dead: set[jax.Device]) -> None:
  """Overwrite every buffer the ``dead`` devices hold with NaN (integers: -1), in place.

  A failed device's memory is gone: after this, anything that still read it
  would carry NaN into the loss.
  """
  def spoil(array):
    if not isinstance(array, jax.Array) or not dead & set(array.sharding.device_set):
      return array
    bad = np.nan if jnp.issubdtype(array.dtype, jnp.inexact) else -1
    pieces = [jax.device_put(np.full(s.data.shape, bad, s.data.dtype), s.device)
              if s.device in dead else s.data for s in array.addressable_shards]
    return jax.make_array_from_single_device_arrays(array.shape, array.sharding, pieces)

  for program in programs:
    program.params = jax.tree.map(spoil, program.params)
    program.opt_state = jax.tree.map(spoil, program.opt_state)


class PeerSource(BaseSource):
  """Logical state from the live replicas of the old programs (a ``LogicalSource``).

  Every class of the new plan is made by a ``peer_move.PeerMove``: only the shard units
  whose device changes move, device to device. In one process each class has its own
  (``direct``); across processes one move serves every class, its buffers between
  processes carried by one collective (``over_processes``).

  Args:
    programs: the old plan's class programs (their state poisoned on ``dead``).
    dead: devices that failed (never read).
    devices: the job's devices; in a multi-process job the live ones carry the
      moves between processes (``over_processes``).
    cache: where the programs of the moves are kept (the run's ``ProgramCache``, so
      that a move compiled ahead is the one run; default: a fresh one).

  Attributes:
    copied_bytes: bytes copied between devices by the moves that ran.
    crossed_bytes: of those, bytes that changed process.
    transfer_s: the seconds those moves took.

  Raises (from a move's call, ``over_processes``):
    LookupError: some piece has no live copy in any replica (then the
      caller falls back to the last checkpoint).
  """

  def __init__(self, programs: list, dead: set[jax.Device],
               devices: Sequence[jax.Device] | None = None, cache: ProgramCache | None = None):
    self.programs = programs
    self.cache = cache or ProgramCache()
    self.dead = dead
    self.devices = list(devices) if devices is not None else None
    self.crossed_bytes = 0
    self._moves: list[PeerMove] = []
    self._nodes: dict[int, tuple[Any, dict[Path, Any]]] = {}  # per old class, its state's nodes
    self._old = [(program.mesh, {leaf.path: leaf for leaf in leaves_of(
        {"params": program.params, "opt_state": program.opt_state})[0]})
                 for program in programs]  # metadata: shapes and layouts

  @property
  def copied_bytes(self) -> int:
    return sum(m.copied_bytes for m in self._moves if m.ran)

  @property
  def transfer_s(self) -> float:
    """Seconds the moves that ran took, until their arrays were ready (building the new
    plan's class programs around them not counted)."""
    return sum(m.seconds for m in self._moves if m.ran)

  def direct(self, leaves: list[Leaf], mesh) -> ClassMove:
    """The move of a new class's ``leaves`` onto ``mesh`` (a ``peer_move.PeerMove`` of one
    class, planned now from metadata; its call raises ``LookupError`` when some piece has
    no live copy)."""
    move = PeerMove(self._old, self.dead, [(leaves, mesh)], self._read, self.cache)
    self._moves.append(move)
    return ClassMove(move, 0)

  def _read(self, index: int, path: Path) -> dict[jax.Device, jax.Array]:
    """Old class ``index``'s buffers of ``path`` now (after ``poison``, before any step)."""
    program = self.programs[index]
    state = (id(program.params), id(program.opt_state))
    if self._nodes.get(index, (None,))[0] != state:
      leaves, _, nodes = leaves_of({"params": program.params, "opt_state": program.opt_state})
      self._nodes[index] = (state, {leaf.path: node for leaf, node in zip(leaves, nodes)})
    node = self._nodes[index][1][path]
    return per_device(node.get_value() if isinstance(node, nnx.Variable) else node)

  def over_processes(self, targets: list[Any], meshes: list, t_min: int, *, run: bool = True
                     ) -> PeersAcross:
    """A multi-process job: one ``PeerMove`` for every class of the new plan, the buffers
    between processes carried by one collective over the live devices (every live process
    must call this). ``run=False``: planned and its programs made, nothing run (its
    ``lower``).

    Raises:
      LookupError: some piece has no live copy (then the caller restores a checkpoint).
    """
    devices = self.devices if self.devices is not None else jax.devices()
    live = [d for d in devices if d not in self.dead]
    if not self.programs:
      raise LookupError("no replica of the old plan is left on the live processes")
    classes = [(leaves_of(target)[0], mesh) for target, mesh in zip(targets, meshes)]
    move = PeerMove(self._old, self.dead, classes, self._read, self.cache, live=live)
    if move.missing is not None:
      raise LookupError(move.missing)
    across = PeersAcross(move, list(meshes))
    self._moves.append(move)
    if run:
      move.run()
      self.crossed_bytes = move.crossed_bytes
    return across

  def describe(self) -> str:
    return f"live DP peers ({len(self.dead)} failed device(s))"


class PeersAcross(BaseSource):
  """The new plan's state moved from live DP peers across processes (``over_processes``):
  each class's arrays, spanning the processes, handed over as they are (``direct``).

  Attributes:
    move: the ``PeerMove`` of every class. copied_bytes, crossed_bytes: as ``PeerMove``'s.
  """

  spans_processes = True

  def __init__(self, move: PeerMove, meshes: list):
    self.move, self._meshes = move, meshes

  @property
  def copied_bytes(self) -> int:
    return self.move.copied_bytes

  @property
  def crossed_bytes(self) -> int:
    return self.move.crossed_bytes

  def lower(self) -> list[jax.stages.Lowered]:
    """The move's programs (this process's packs and unpacks, and the collective)."""
    return self.move.lower() or []

  def direct(self, leaves: list[Leaf], mesh) -> ClassMove:
    """Class ``mesh``'s arrays from the move (lowered with it: its ``lower`` is empty)."""
    return ClassMove(self.move, self._meshes.index(mesh), lowers=False)

  def describe(self) -> str:
    return "live DP peers, across processes"
