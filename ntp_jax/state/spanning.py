"""Logical state as arrays that span every process (multi-process checkpoints and restore).

In a multi-process job a class program runs only in the processes that hold
its devices, but orbax saves and restores collectively: every process makes
the same calls, and an array held by one process alone is refused as
"host local". So the job's logical state is read and written through arrays
over *every live replica*: a split leaf is cut into ``k`` even pieces over
slots ``0..k-1`` of each replica (``k`` = the largest divisor of its size
that is at most the job's smallest TP degree, so every replica can hold
them), replicated over replicas; an unsplit leaf (norm scales, step counts)
lives on every live device. Each process supplies or receives only the
pieces of its own devices; orbax writes one copy (replica 0's) and every
device reads only the pieces it holds.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.program_cache import ProgramCache, abstract
from ntp_jax.sharding.topology import holds_mine, is_mine, mine, processes_of
from ntp_jax.state.placement import (
  BaseSource,
  Leaf,
  LogicalSource,
  Path,
  PerDeviceMap,
  add_lead,
  copy_of_replica,
  drop_lead,
  even_pieces,
  even_pieces_of,
  leaves_of,
  per_device,
  per_device_map,
)

ROW = "replica"
PIECE = "piece"


def spanning_sharding(leaf: Leaf, rows: list[list[jax.Device]], k: int) -> NamedSharding:
  """``leaf`` over every replica row: split over each row's first ``k`` devices, or
  (unsplit) replicated on every device of every row."""
  if leaf.layout is None:
    flat = [d for row in rows for d in row]
    return NamedSharding(Mesh(np.array(flat, dtype=object), (PIECE,)), P())
  spec = [None] * len(leaf.shape)
  spec[leaf.axis] = PIECE
  grid = np.array([row[:k] for row in rows], dtype=object)
  return NamedSharding(Mesh(grid, (ROW, PIECE)), P(*spec))


def job_pieces(leaf: Leaf, t_min: int) -> int:
  """Pieces of a split leaf that every replica can hold (``k <= t_min``)."""
  return even_pieces(leaf.layout.size, t_min) if leaf.layout is not None else 1


def read_logical_spanning(classes: list[tuple[Any, Mesh]], t_min: int,
                          cache: ProgramCache | None = None) -> dict[Path, jax.Array]:
  """The job's logical state (``placement.read_logical``'s result) spanning every process.

  Args:
    classes: ``(state, mesh)`` of every class in plan order; the state of a
      class with no device in this process may be abstract (not read).
    t_min: the job's smallest TP degree.
    cache: where the programs are kept (default: a fresh ``ProgramCache``).

  Returns:
    ``path -> jax.Array`` of the logical shape, sharded as ``spanning_sharding``;
    this process holds the pieces on its own devices (maybe none).
  """
  cache = cache or ProgramCache()
  rows = [list(row) for _, mesh in classes for row in mesh.devices]
  leaves, _, _ = leaves_of(classes[0][0])
  k = {leaf.path: job_pieces(leaf, t_min) for leaf in leaves}
  local: dict[Path, list[jax.Array]] = {leaf.path: [] for leaf in leaves}
  for state, mesh in classes:
    if holds_mine(mesh):
      class_leaves, nodes, moved = even_pieces_of(state, mesh, k, cache)
      held = {leaf.path: per_device(moved[leaf.path]) for leaf in class_leaves
              if leaf.layout is not None}
      split_pieces = per_device_map(drop_lead, {
          (path, device): by_device[device] for path, by_device in held.items()
          for row in mesh.devices for device in row[:k[path]] if is_mine(device)}, cache)
      for leaf, node in zip(class_leaves, nodes):
        for r, row in enumerate(mesh.devices):
          if leaf.layout is not None:
            local[leaf.path] += [split_pieces[(leaf.path, d)] for d in row[:k[leaf.path]]
                                 if is_mine(d)]
          else:
            own = mine(row)
            if own:  # a copy from one of this process's devices of the row, to each of them
              copy = copy_of_replica(node, leaf, own[0], r)
              local[leaf.path] += [jax.device_put(copy, d) for d in own]
  return {leaf.path: jax.make_array_from_single_device_arrays(
      leaf.shape, spanning_sharding(leaf, rows, k[leaf.path]), local[leaf.path],
      dtype=leaf.dtype) for leaf in leaves}


class SpanningArrays(BaseSource):
  """Logical arrays spanning every process (``spanning_sharding``) as a ``LogicalSource``:
  each class is placed from the pieces its devices hold (``placement.place_logical``
  asks through ``read_blocks``, ``read`` and ``pieces``).

  Args:
    arrays: ``path -> jax.Array`` in the spanning sharding over the classes' rows.
    t_min: the split's bound: ``k = job_pieces(leaf, t_min)``.
    cache: where the programs are kept (default: a fresh ``ProgramCache``).
  """

  spans_processes = True  # build_class_programs places it as it is
  serves_blocks = True

  def __init__(self, arrays: dict[Path, jax.Array], t_min: int,
               cache: ProgramCache | None = None):
    self.t_min = t_min
    self.cache = cache or ProgramCache()
    self._arrays = arrays
    self._paths = set(arrays)

  def paths(self) -> set[Path]:
    return set(self._paths)

  def pieces(self, leaf: Leaf) -> int:
    return job_pieces(leaf, self.t_min)

  def describe(self) -> str:
    return "logical arrays over every process"

  def spanning_spec(self, path: Path) -> jax.ShapeDtypeStruct:
    """The logical array of ``path`` as it spans the processes: shape, dtype, sharding."""
    return abstract(self._arrays[path])

  def _shard_specs(self, requests: dict[Path, jax.ShapeDtypeStruct]
                   ) -> dict[tuple[Path, jax.Device], jax.ShapeDtypeStruct]:
    """``(path, device) -> `` this process's piece of each requested logical array, from
    metadata (what ``_shards`` will hand over)."""
    out = {}
    for path in requests:
      spec = self.spanning_spec(path)
      shape = spec.sharding.shard_shape(spec.shape)
      for device in sorted(spec.sharding.addressable_devices, key=lambda d: d.id):
        out[(path, device)] = jax.ShapeDtypeStruct(shape, spec.dtype,
                                                   sharding=SingleDeviceSharding(device))
    return out

  def _shards(self, requests: dict[Path, jax.ShapeDtypeStruct]
              ) -> dict[tuple[Path, jax.Device], jax.Array]:
    return {(path, s.device): s.data for path in requests
            for s in self._arrays[path].addressable_shards}

  def read_blocks(self, requests: dict[Path, jax.ShapeDtypeStruct]
                  ) -> dict[Path, dict[jax.Device, jax.Array]]:
    """Split leaves: ``path -> {device: [1, 1, *piece]}`` for this process's devices."""
    out: dict[Path, dict[jax.Device, jax.Array]] = {path: {} for path in requests}
    lift = PerDeviceMap(add_lead, self._shard_specs(requests), self.cache)
    for (path, device), x in lift(self._shards(requests)).items():
      out[path][device] = x
    return out

  def read_programs(self, blocks: dict[Path, jax.ShapeDtypeStruct],
                    rest: dict[Path, jax.ShapeDtypeStruct]) -> list[PerDeviceMap]:
    """``read_blocks``' lift of each piece to ``[1, 1, *piece]`` (from metadata: the arrays
    may not be there yet); ``read`` runs none."""
    return [PerDeviceMap(add_lead, self._shard_specs(blocks), self.cache)] if blocks else []

  def read(self, requests: dict[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.Array]:
    """Unsplit leaves, replicated over the requested class mesh (local copies reused)."""
    out = {}
    for path, request in requests.items():
      by_device = per_device(self._arrays[path])
      sharding = request.sharding
      out[path] = jax.make_array_from_single_device_arrays(
          request.shape, sharding,
          [by_device[d] for d in mine(sharding.mesh)], dtype=request.dtype)
    return out


class SpanningSource(SpanningArrays):
  """Wraps a ``LogicalSource`` for a multi-process job: one collective read of every
  leaf over every replica (``spanning_sharding``), then each class placed from the
  pieces its devices hold (``SpanningArrays``).

  Args:
    source: the source to read (a checkpoint, an initialiser, a Hugging Face folder).
    target: the first class's abstract state (its leaves name the logical arrays).
    meshes: every class's mesh, in plan order. t_min: the smallest TP degree.
    cache: where the programs are kept (default: a fresh ``ProgramCache``).

  Raises:
    What ``source.read`` raises.
  """

  def __init__(self, source: LogicalSource, target: Any, meshes: list[Mesh], t_min: int,
               cache: ProgramCache | None = None):
    self.source = source
    leaves, _, _ = leaves_of(target)
    available = source.paths()
    wanted = [leaf for leaf in leaves if available is None or leaf.path in available]
    rows = [list(row) for mesh in meshes for row in mesh.devices]
    requests = {leaf.path: leaf.abstract(spanning_sharding(leaf, rows, job_pieces(leaf, t_min)))
                for leaf in wanted}
    super().__init__(source.read(requests) if requests else {}, t_min, cache)

  def describe(self) -> str:
    return f"{self.source.describe()}, read once over every process"


def processes_without_pieces(classes: list[tuple[Any, Mesh]], t_min: int) -> dict[int, str]:
  """Processes that would hold no piece of some logical array (``process -> leaf name``).

  orbax's collective save needs every process to hold a piece of every
  array; a process whose devices are all past the first ``k`` slots of
  their replicas (a TP group over several processes, ``k`` small) holds
  none. The same answer in every process: it depends on the plan only.
  """
  rows = [list(row) for _, mesh in classes for row in mesh.devices]
  processes = processes_of(d for row in rows for d in row)
  leaves, _, _ = leaves_of(classes[0][0])
  missing: dict[int, str] = {}
  for leaf in leaves:
    if leaf.layout is None:
      continue
    k = job_pieces(leaf, t_min)
    holders = processes_of(d for row in rows for d in row[:k])
    for process in sorted(processes - holders):
      missing.setdefault(process, leaf.name)
  return missing
