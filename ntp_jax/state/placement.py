"""One way to put logical state onto a plan, and to read it back off one.

*Logical state* is the job's training state as a nested dict of arrays with
real global shapes: no padding, no replica axis, shared units once. A class
program holds it as padded per-slot blocks, one copy per replica
(``ntp_jax.layers.shard.replica_specs``). Initialisation, checkpoint restore, weight
import and live recovery all go the same way: the *target* is
the class's abstract state (shapes, layouts, shardings); a *source* fills
logical arrays laid out evenly over some of the class's devices; one program
per class moves them into the padded blocks, device to device. A
``Placement`` decides all of it from metadata and holds the programs (from the
caller's ``ProgramCache``): calling it runs them, its ``lower`` lowers the
same objects ahead of time (``ntp_jax.training.precompile``).

The even layout of a split dimension of ``n`` elements on a class of TP
degree ``t`` uses ``k`` = the largest divisor of ``n`` not above ``t``: slots
``0..k-1`` of each replica hold ``n / k`` elements each, which is a plain
``NamedSharding`` that orbax and ``jax.jit`` accept (JAX rejects shardings
that do not divide). Replicated variables (norm scales) and scalars (step
counts) are read replicated. Moving between the even layout and a class's
layout is ``collectives.reshard_uneven``: only the elements that change
device move, nothing is gathered on one device or one host.

Paths name leaves of ``{"params": ..., "opt_state": ...}``: dict keys,
attribute names and sequence indices as strings, e.g.
``("params", "blocks", "attn", "wq")`` or
``("opt_state", "0", "mu", "embed", "embedding")``. A leaf held in an
``nnx.Variable`` carries a leading replica axis in the class state; a bare
array (optax step counts) is replicated over the class mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.layers.params import TPParam
from ntp_jax.program_cache import Lowerable, ProgramCache, abstract
from ntp_jax.sharding.collectives import copy_shared_from_last, reshard_uneven
from ntp_jax.sharding.layout import Layout, owner_layout
from ntp_jax.sharding.mesh import DP, TP
from ntp_jax.sharding.topology import is_mine

Path = tuple[str, ...]
GROUP_BYTES = 256 * 2**20  # per device: leaves moved together in one stacked array


def is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


@dataclasses.dataclass(frozen=True)
class Leaf:
  """How one leaf of a class state maps to its logical array.

  Attributes:
    path: the leaf's logical path.
    shape: logical (global, unpadded) shape.
    dtype: the class state's dtype.
    layout: the TP split of ``axis`` for a ``TPParam``, else None.
    axis: the split axis in logical coordinates, or None.
    stacked: the class state has a leading replica axis (``nnx.Variable``s).
  """

  path: Path
  shape: tuple[int, ...]
  dtype: np.dtype
  layout: Layout | None = None
  axis: int | None = None
  stacked: bool = True
  k: int | None = None  # pieces of the even layout; default: ``even_pieces(n, degree)``

  @property
  def name(self) -> str:
    return "/".join(self.path)

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape)) * self.dtype.itemsize

  @property
  def pieces(self) -> int:
    """``k``: slots holding the even layout of a split leaf (1 if not split)."""
    if self.layout is None:
      return 1
    return self.k if self.k is not None else even_pieces(self.layout.size, self.layout.degree)

  @property
  def even_layout(self) -> Layout:
    """The split axis cut into ``k`` equal runs on slots ``0..k-1`` (in elements)."""
    k, n = self.pieces, self.layout.size
    units = (n // k,) * k + (0,) * (self.layout.degree - k)
    return Layout(tp=self.layout.tp, live_slots=self.layout.live_slots, units=units)

  def even_sharding(self, mesh: Mesh) -> NamedSharding:
    """Sharding of the logical array on a class mesh: the split axis over slots
    ``0..k-1`` of every replica (replicated over replicas); replicated when not split."""
    devices = mesh.devices
    if self.layout is None:
      return NamedSharding(Mesh(devices, (DP, TP)), P())
    spec = [None] * len(self.shape)
    spec[self.axis] = TP
    return NamedSharding(Mesh(devices[:, :self.pieces], (DP, TP)), P(*spec))

  @property
  def piece_shape(self) -> tuple[int, ...]:
    """Shape of one piece of the even layout (the whole array when not split)."""
    if self.layout is None:
      return self.shape
    return block_shape(self, self.layout.size // self.pieces)

  def piece_sharding(self, devices) -> NamedSharding:
    """The even layout on ``devices`` (one per piece; one device when not split)."""
    row = np.array([list(devices)], dtype=object)
    if self.layout is None:
      return NamedSharding(Mesh(row, (DP, TP)), P())
    spec = [None] * len(self.shape)
    spec[self.axis] = TP
    return NamedSharding(Mesh(row, (DP, TP)), P(*spec))

  def abstract(self, sharding: jax.sharding.Sharding | None = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=sharding)


def even_pieces(n: int, degree: int) -> int:
  """The largest divisor of ``n`` that is at most ``degree`` (at least 1)."""
  return max(k for k in range(1, max(1, min(n, degree)) + 1) if n % k == 0)


def leaves_of(state: Any) -> tuple[list[Leaf], Any, list[Any]]:
  """Logical description of every leaf of a class state.

  Args:
    state: ``{"params": ..., "opt_state": ...}`` (or any tree) of a class,
      concrete or abstract, replica-stacked as ``build_class_programs``
      keeps it.

  Returns:
    ``(leaves, treedef, nodes)``: one ``Leaf`` per tree leaf, the treedef
    (``nnx.Variable``s as leaves) and the leaves themselves.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_variable)
  leaves = []
  for key_path, node in flat:
    path = tuple(key_name(k) for k in key_path)
    if isinstance(node, nnx.Variable):
      value = node.get_value()
      shape = tuple(value.shape[1:])  # drop the replica axis
      if isinstance(node, TPParam):
        shape = list(shape[1:])  # drop the slot axis
        shape[node.tp_axis] = node.tp_layout.size
        leaves.append(Leaf(path, tuple(shape), np.dtype(value.dtype), node.tp_layout,
                           node.tp_axis))
      else:
        leaves.append(Leaf(path, shape, np.dtype(value.dtype)))
    else:
      leaves.append(Leaf(path, tuple(node.shape), np.dtype(node.dtype), stacked=False))
  return leaves, treedef, [node for _, node in flat]


class DirectMove(Protocol):
  """A class's state made by its source in one operation (``LogicalSource.direct``)."""

  copied_bytes: int  # bytes it carries between devices

  def __call__(self) -> dict[Path, jax.Array]:
    """``path -> array`` in the class sharding (blocks ``P('dp', 'tp')``, replica-stacked
    ``P('dp')``, bare ``P()``)."""

  def lower(self) -> list[jax.stages.Lowered] | None:
    """Its programs lowered (None: it cannot run, and its call raises)."""


class LogicalSource(Protocol):
  """Where logical arrays come from (an initialiser, a checkpoint, a live replica).

  ``Placement`` calls every method; ``BaseSource`` gives the defaults, so a
  source defines ``read`` and whichever of the others it has reason to.

  Attributes:
    serves_blocks: ``read_blocks`` hands over every split leaf ``place_logical`` wants
      (``read`` is asked for none of them); else ``read`` is asked for them all.
    spans_processes: in a multi-process job the source's arrays already span every
      process (``spanning.SpanningArrays``): ``programs.build_class_programs`` places
      from it as it is, not through ``over_processes``.
  """

  serves_blocks: bool
  spans_processes: bool

  def paths(self) -> set[Path] | None:
    """The paths the source can fill (the others are left to the caller); None: every
    path the target has."""

  def read(self, requests: dict[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.Array]:
    """Per path, the logical array laid out as the request's ``sharding`` says (which
    devices, which even split), with the request's shape and dtype."""

  def pieces(self, leaf: Leaf) -> int | None:
    """``k``, the even split to request for a split ``leaf``; None: ``even_pieces``."""

  def direct(self, leaves: list[Leaf], mesh: Mesh) -> DirectMove | None:
    """An operation that hands every leaf of ``leaves`` over in the class sharding on
    ``mesh`` by itself (live DP peers move only what changes device, ``peer_move``),
    decided from metadata; None: the leaves go through the reads and this module's
    programs."""

  def read_blocks(self, requests: dict[Path, jax.ShapeDtypeStruct]
                  ) -> dict[Path, dict[jax.Device, jax.Array]]:
    """Split leaves as ``[1, 1, *piece]`` buffers on each requested device of this
    process, every path of ``requests`` (asked only when ``serves_blocks``)."""

  def read_programs(self, blocks: dict[Path, jax.ShapeDtypeStruct],
                    rest: dict[Path, jax.ShapeDtypeStruct]) -> list[Lowerable] | None:
    """The compiled operations that ``read_blocks(blocks)`` and ``read(rest)`` run, the very
    objects those calls use (each ``lower()``s itself, for compiling ahead); ``[]``: they
    run no program of ours; None when the source cannot tell before it reads (then
    ``Placement.lower`` gives up)."""

  def over_processes(self, targets: list[Any], meshes: list[Mesh], t_min: int, *,
                     run: bool = True) -> LogicalSource | None:
    """A multi-process job: a source of the same state whose arrays span every process
    (``spans_processes``), made the source's own way (live DP peers move theirs across
    processes); None: read it once over every process (``spanning.SpanningSource``).

    Args:
      targets: every class's abstract state, in plan order (their leaves and layouts).
      meshes: every class's mesh, in plan order. t_min: the smallest TP degree.
      run: False: for compiling ahead, the source with its moves planned but not run;
        its ``lower()`` lowers them, and its ``read_programs`` (or ``direct``) tell what
        placing from it runs.
    """

  def describe(self) -> str:
    """One line for logs naming the source."""


class BaseSource:
  """Defaults of ``LogicalSource``: every path, the default even split, no direct move,
  every leaf through ``read`` (no blocks handed over), nothing known ahead, not
  spanning processes (read over them by ``spanning.SpanningSource``), the class name.
  Subclasses define ``read``.
  """

  serves_blocks = False
  spans_processes = False

  def paths(self) -> set[Path] | None:
    return None

  def read(self, requests: dict[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.Array]:
    raise NotImplementedError(f"{type(self).__name__}.read")

  def pieces(self, leaf: Leaf) -> int | None:
    return None

  def direct(self, leaves: list[Leaf], mesh: Mesh) -> DirectMove | None:
    return None

  def read_blocks(self, requests: dict[Path, jax.ShapeDtypeStruct]
                  ) -> dict[Path, dict[jax.Device, jax.Array]]:
    raise NotImplementedError(f"{type(self).__name__}.read_blocks (serves_blocks is False)")

  def read_programs(self, blocks: dict[Path, jax.ShapeDtypeStruct],
                    rest: dict[Path, jax.ShapeDtypeStruct]) -> list[Lowerable] | None:
    return None

  def over_processes(self, targets: list[Any], meshes: list[Mesh], t_min: int, *,
                     run: bool = True) -> LogicalSource | None:
    return None

  def describe(self) -> str:
    return type(self).__name__


def per_device(array: jax.Array) -> dict[jax.Device, jax.Array]:
  return {s.device: s.data for s in array.addressable_shards}


def _transfer_body(split: tuple[Leaf, ...], mesh: Mesh, to_blocks: bool) -> Callable[..., Any]:
  """Jitted ``shard_map`` moving split leaves between the even layout and their layouts.

  Per device, every array is ``[1, 1, *block]`` (``P('dp', 'tp')``).
  """

  # Leaves with one layout, axis and shape (a kernel, its two Adam moments, every
  # layer's copy) move as one stacked array: one schedule, a fraction of the compile.
  # A group is capped at GROUP_BYTES per device, which bounds the temporaries of the move.
  groups: list[list[int]] = []
  open_groups: dict[Any, list[int]] = {}
  for i, leaf in enumerate(split):
    key = (leaf.layout, leaf.axis, leaf.shape)
    members = open_groups.get(key)
    if members is None or (len(members) + 1) * leaf.nbytes // leaf.pieces > GROUP_BYTES:
      members = open_groups[key] = []
      groups.append(members)
    members.append(i)

  def move(x, leaf):  # x: [count, *block of the source layout]; the split axis is 1 + axis
    axis = 1 + leaf.axis
    if not to_blocks:  # [..., block, ...] -> [..., n/k, ...]
      return reshard_uneven(x, owner_layout(leaf.layout), leaf.even_layout, axis)
    layout = leaf.layout  # [..., n/k, ...] -> [..., block, ...]
    return copy_shared_from_last(reshard_uneven(x, leaf.even_layout, owner_layout(layout), axis),
                                 layout, axis)

  def body(*blocks):
    out: list[Any] = [None] * len(split)
    for members in groups:
      leaf = split[members[0]]
      dtype = jnp.result_type(*(blocks[i].dtype for i in members))
      moved = move(jnp.stack([blocks[i][0, 0].astype(dtype) for i in members]), leaf)
      for n, i in enumerate(members):
        out[i] = moved[n].astype(split[i].dtype if to_blocks else blocks[i].dtype)[None, None]
    return tuple(out)

  spec = P(DP, TP)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(split),
                               out_specs=(spec,) * len(split)))


def transfer_program(cache: ProgramCache, split: tuple[Leaf, ...], mesh: Mesh,
                     to_blocks: bool) -> Callable[..., Any]:
  """The jitted move of ``split`` leaves between their layouts (``to_blocks=False``) and the
  even layouts (``to_blocks=True``) on ``mesh``, made once per run in ``cache``: every
  argument and result is ``[replicas, degree, *block]`` (``P('dp', 'tp')``), in the order of
  ``split``, a plan met again (a repaired replica, a recovery compiled ahead) compiles
  nothing."""
  return cache.program(("placement transfer", split, mesh, to_blocks),
                       lambda: _transfer_body(split, mesh, to_blocks))


def block_shape(leaf: Leaf, length: int | None = None) -> tuple[int, ...]:
  """The leaf's shape with the split axis ``length`` long (default: its padded block)."""
  if length is None:
    length = leaf.layout.block
  shape = list(leaf.shape)
  shape[leaf.axis] = length
  return tuple(shape)


class EvenPieces:
  """Every replica's split leaves of a class state moved to their even layouts: one program.

  Args:
    state: a class's replica-stacked state, arrays or ``jax.ShapeDtypeStruct``s with the
      class shardings (``programs.class_shardings``).
    mesh: its ``('dp', 'tp')`` mesh.
    pieces: ``path -> k`` to use instead of the default even split.
    cache: where the program is kept (default: a fresh ``ProgramCache``).

  Attributes:
    leaves, nodes: the state's leaves (with ``k`` set) and nodes (``leaves_of``).
    split: the split leaves, in the program's argument order.

  Calling it runs the program on the state's arrays; ``lower`` lowers the same program for
  their shapes and shardings (nothing read), so that call then compiles nothing.
  """

  def __init__(self, state: Any, mesh: Mesh, pieces: dict[Path, int] | None = None,
               cache: ProgramCache | None = None):
    leaves, _, nodes = leaves_of(state)
    pieces = pieces or {}
    self.leaves = [dataclasses.replace(leaf, k=pieces.get(leaf.path)) for leaf in leaves]
    self.nodes = nodes
    self._split = [(leaf, node) for leaf, node in zip(self.leaves, nodes)
                   if leaf.layout is not None]
    self.split = tuple(leaf for leaf, _ in self._split)
    self.program = (transfer_program(cache or ProgramCache(), self.split, mesh, to_blocks=False)
                    if self.split else None)

  def _values(self) -> list[Any]:
    return [node.get_value() for _, node in self._split]

  def __call__(self) -> dict[Path, jax.Array]:
    """Per split leaf, a ``[replicas, degree, *piece]`` array (``P('dp', 'tp')``) whose
    ``(r, j)`` block is replica ``r``'s piece ``j`` (``j < k``; zeros beyond)."""
    if self.program is None:
      return {}
    return dict(zip((leaf.path for leaf in self.split), self.program(*self._values())))

  def lower(self) -> list[jax.stages.Lowered]:
    return [] if self.program is None else [self.program.lower(*abstract(self._values()))]


def even_pieces_of(state: Any, mesh: Mesh, pieces: dict[Path, int] | None = None,
                   cache: ProgramCache | None = None
                   ) -> tuple[list[Leaf], list[Any], dict[Path, jax.Array]]:
  """Every replica's split leaves moved to their even layouts, on the class's devices.

  Args:
    state: a class's replica-stacked state. mesh: its ``('dp', 'tp')`` mesh.
    pieces: ``path -> k`` to use instead of the default even split.
    cache: where the program is kept (default: a fresh ``ProgramCache``).

  Returns:
    ``(leaves, nodes, moved)``: the state's leaves (with ``k`` set) and
    nodes, and for each split leaf a ``[replicas, degree, *piece]`` array
    (``P('dp', 'tp')``) whose ``(r, j)`` block is replica ``r``'s piece ``j``
    (``j < k``; zeros beyond). ``EvenPieces`` is the operation.
  """
  move = EvenPieces(state, mesh, pieces, cache)
  return move.leaves, move.nodes, move()


def read_logical(state: Any, mesh: Mesh, replica: int = 0,
                 cache: ProgramCache | None = None) -> dict[Path, jax.Array]:
  """One replica's copy of a class state as logical arrays, evenly split, device to device.

  Args:
    state: a class's replica-stacked state (``{"params", "opt_state"}``).
    mesh: the class's ``('dp', 'tp')`` mesh.
    replica: row of the class mesh (position in the class, not the DP index).
    cache: where the programs are kept (default: a fresh ``ProgramCache``, which
      compiles them again).

  Returns:
    ``path -> jax.Array`` of the logical shape. A split leaf is sharded over
    the replica's slots ``0..k-1``; other leaves live on its first device.
    Every piece is produced where the data lives; nothing passes through the
    host.
  """
  cache = cache or ProgramCache()
  leaves, nodes, moved = even_pieces_of(state, mesh, cache=cache)
  row = mesh.devices[replica]
  split = [leaf for leaf in leaves if leaf.layout is not None]
  blocks = {leaf.path: per_device(moved[leaf.path]) for leaf in split}
  # Drop the [1, 1] lead of every piece: one dispatch per device, not one per piece.
  pieces = per_device_map(drop_lead, {
      (leaf.path, j): blocks[leaf.path][row[j]] for leaf in split for j in range(leaf.pieces)},
      cache)
  out = {}
  for leaf, node in zip(leaves, nodes):
    if leaf.layout is not None:
      out[leaf.path] = jax.make_array_from_single_device_arrays(
          leaf.shape, leaf.piece_sharding(row[:leaf.pieces]),
          [pieces[(leaf.path, j)] for j in range(leaf.pieces)])
    else:
      piece = copy_of_replica(node, leaf, row[0], replica)
      out[leaf.path] = jax.make_array_from_single_device_arrays(
          leaf.shape, leaf.piece_sharding(row[:1]), [piece])
  return out


class PerDeviceMap:
  """``fn`` applied to many single-device arrays: one jitted call per device.

  Reshaping hundreds of small buffers one by one costs a dispatch each (and,
  on first use, a compilation per shape and device); grouped by device it is
  one program per device.

  Args:
    fn: ``array -> array`` on one device (a module-level function: it keys the cache).
    arrays: ``key -> `` single-device array or ``jax.ShapeDtypeStruct`` with a
      ``SingleDeviceSharding`` (or a list of them on one device): the arguments the call
      will get.
    cache: where the program is kept (default: a fresh ``ProgramCache``).

  Attributes:
    keys: the keys of ``arrays``, in order.

  Calling it with ``key -> array`` of those shapes and devices gives ``key -> fn(array)``;
  ``lower`` lowers the programs for them.
  """

  def __init__(self, fn: Callable[[jax.Array], jax.Array], arrays: dict[Any, Any],
               cache: ProgramCache | None = None):
    self.program = (cache or ProgramCache()).program(
        ("per device", fn), lambda: jax.jit(lambda xs: [fn(x) for x in xs]))
    self.keys = list(arrays)
    self._groups = _by_device(arrays)
    self._specs = {k: abstract(arrays[k]) for k in self.keys}

  def __call__(self, arrays: dict[Any, jax.Array]) -> dict[Any, jax.Array]:
    out = {}
    for keys in self._groups:
      out.update(zip(keys, self.program([arrays[k] for k in keys])))
    return out

  def lower(self) -> list[jax.stages.Lowered]:
    return [self.program.lower([self._specs[k] for k in keys]) for keys in self._groups]


def per_device_map(fn: Callable[[jax.Array], jax.Array], arrays: dict[Any, jax.Array],
                   cache: ProgramCache | None = None) -> dict[Any, jax.Array]:
  """``PerDeviceMap(fn, arrays, cache)(arrays)``: ``key -> fn(array)``, one jitted call per
  device."""
  return PerDeviceMap(fn, arrays, cache)(arrays)


def _by_device(arrays: dict[Any, Any]) -> list[list[Any]]:
  """The keys of single-device arrays (or sharded ``ShapeDtypeStruct``s), grouped by device
  in first-seen order: one ``PerDeviceMap`` call per group."""
  by_device: dict[jax.Device, list[Any]] = {}
  for key, array in arrays.items():
    first = jax.tree.leaves(array)[0]  # an argument may be a list of arrays on one device
    by_device.setdefault(next(iter(first.sharding.device_set)), []).append(key)
  return list(by_device.values())


def drop_lead(x: jax.Array) -> jax.Array:
  return x[0, 0]


def add_lead(x: jax.Array) -> jax.Array:
  return x[None, None]


def copy_of_replica(node: Any, leaf: Leaf, device: jax.Device, replica: int) -> jax.Array:
  """A copy of replica ``replica``'s value of an unsplit leaf, from its buffer on ``device``.

  A copy: the step donates the state's buffers, the caller may keep this one.
  """
  value = node.get_value() if leaf.stacked else node
  shard = [s for s in value.addressable_shards if s.device == device][0]
  return shard.data[replica - (shard.index[0].start or 0)] if leaf.stacked else shard.data + 0


class Placement:
  """Filling a class's state from a source of logical arrays: what runs, and its programs.

  Everything is decided at construction from metadata: the target's leaves and
  layouts, the mesh, and what the source declares (``paths``, ``pieces``,
  ``direct``, ``serves_blocks``); nothing is read
  until the call. A source with a direct move (live DP peers) makes the state itself;
  otherwise each replica's devices read the even pieces they hold (split
  leaves: slots ``0..k-1``; others: every device), then one program per class
  moves the pieces into the padded blocks. ``lower`` lowers the programs the
  call runs (the same objects, from the same ``cache``), so once they are
  compiled the call compiles nothing.

  Args:
    target: the class's abstract replica-stacked state (``jax.eval_shape`` of it;
      ``nnx.Variable`` metadata carries the layouts).
    mesh: the class's ``('dp', 'tp')`` mesh (rows = replicas).
    source: fills the paths it has (see ``LogicalSource``).
    cache: where the programs are kept (default: a fresh ``ProgramCache``).

  Attributes:
    requests: ``path -> jax.ShapeDtypeStruct`` (logical shape, class dtype, the even
      sharding) of every leaf the source fills.
    blocks, rest: the requests ``read_blocks`` and ``read`` get.
  """

  def __init__(self, target: Any, mesh: Mesh, source: LogicalSource,
               cache: ProgramCache | None = None):
    cache = cache or ProgramCache()
    self.mesh, self.source = mesh, source
    leaves, treedef, nodes = leaves_of(target)
    available = source.paths()
    # The source may pick each leaf's even split (None: the default).
    self._leaves = [dataclasses.replace(leaf, k=source.pieces(leaf))
                    if leaf.layout is not None else leaf for leaf in leaves]
    self._treedef, self._nodes = treedef, nodes
    self.wanted = [leaf for leaf in self._leaves if available is None or leaf.path in available]
    self.direct = source.direct(self.wanted, mesh)  # the source makes the state itself
    wanted = [] if self.direct is not None else self.wanted
    self.requests = {leaf.path: leaf.abstract(leaf.even_sharding(mesh)) for leaf in wanted}
    # A source that holds the pieces on devices already may hand them over as they are
    # ([1, 1, *piece] per device, split leaves): no program runs on them then.
    self._split = [leaf for leaf in wanted if leaf.layout is not None]
    self._unsplit = [leaf for leaf in wanted if leaf.layout is None]
    self.blocks = ({leaf.path: self.requests[leaf.path] for leaf in self._split}
                   if source.serves_blocks else {})
    self.rest = {p: r for p, r in self.requests.items() if p not in self.blocks}
    # Split leaves read whole: each device's piece lifted to [1, 1, *piece].
    self._lift = PerDeviceMap(add_lead, {
        (leaf.path, d): jax.ShapeDtypeStruct(leaf.piece_shape, leaf.dtype,
                                             sharding=jax.sharding.SingleDeviceSharding(d))
        for leaf in self._split if leaf.path in self.rest
        for d in self.requests[leaf.path].sharding.mesh.devices.flat if is_mine(d)}, cache)
    blocks = NamedSharding(mesh, P(DP, TP))
    self._pieces = [jax.ShapeDtypeStruct(mesh.devices.shape + leaf.piece_shape, leaf.dtype,
                                         sharding=blocks) for leaf in self._split]
    self._transfer = (transfer_program(cache, tuple(self._split), mesh, to_blocks=True)
                      if self._split else None)
    self._stacked = [leaf for leaf in self._unsplit if leaf.stacked and leaf.path in self.rest]
    self._stack = (stack_program(cache, tuple(leaf.dtype for leaf in self._stacked), mesh)
                   if self._stacked else None)

  def lower(self) -> list[jax.stages.Lowered] | None:
    """The programs the call runs, lowered for the shapes and shardings it will meet.

    Returns:
      The lowered programs (empty: nothing runs), or None when the source cannot tell
      what its reads run (``LogicalSource.read_programs``) or its direct move cannot run.
      Reads nothing from the source.
    """
    if self.direct is not None:
      return self.direct.lower()
    reads = self.source.read_programs(self.blocks, self.rest)
    if reads is None:
      return None
    lowered = [lowered for program in reads for lowered in program.lower()]
    lowered += self._lift.lower()
    if self._transfer is not None:
      lowered.append(self._transfer.lower(*self._pieces))
    if self._stack is not None:
      lowered.append(self._stack.lower([self.rest[leaf.path] for leaf in self._stacked]))
    return lowered

  def __call__(self) -> tuple[Any, set[Path]]:
    """Read the source and place its arrays.

    Returns:
      ``(state, filled)``: the target tree with every leaf the source filled
      replaced by a device array in the class sharding (blocks ``P('dp',
      'tp')``, replicated variables ``P('dp')``, scalars ``P()``), and the set
      of filled paths. Leaves the source does not have stay abstract.

    Raises:
      What the source's reads raise (a checkpoint's ``CheckpointError``, a live
      source's ``LookupError``, ...).
    """
    source, mesh = self.source, self.mesh
    if self.direct is not None:
      made = self.direct()
      return self._rebuild(made), set(made)
    blocks = source.read_blocks(self.blocks) if self.blocks else {}
    arrays = source.read(self.rest) if self.rest else {}
    placed: dict[Path, jax.Array] = {}

    if self._split:
      shards = {path: per_device(arrays[path]) for path, _ in self._lift.keys}
      lifted: dict[Path, dict[jax.Device, jax.Array]] = {}
      for (path, device), x in self._lift(
          {(path, d): shards[path][d] for path, d in self._lift.keys}).items():
        lifted.setdefault(path, {})[device] = x
      inputs = []
      for leaf, spec in zip(self._split, self._pieces):
        block = (1, 1) + leaf.piece_shape
        by_device = blocks[leaf.path] if leaf.path in blocks else lifted[leaf.path]
        pieces = []
        for row in mesh.devices:
          for j, device in enumerate(row):
            if not is_mine(device):
              continue  # another process supplies its own devices' pieces
            if j < leaf.pieces:
              pieces.append(by_device[device])
            else:  # slots past k hold none of the even layout (zeros from the host: no compile)
              pieces.append(jax.device_put(np.zeros(block, leaf.dtype), device))
        inputs.append(jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, pieces))
      placed.update(zip((leaf.path for leaf in self._split), self._transfer(*inputs)))
    if self._stack is not None:
      placed.update(zip([leaf.path for leaf in self._stacked],
                        self._stack([arrays[leaf.path] for leaf in self._stacked])))
    for leaf in self._unsplit:
      if not leaf.stacked:
        placed[leaf.path] = jax.device_put(arrays[leaf.path].astype(leaf.dtype),
                                           NamedSharding(mesh, P()))
    return self._rebuild(placed), set(placed)

  def _rebuild(self, placed: dict[Path, jax.Array]) -> Any:
    """The target tree with the placed leaves' values set (the others left as they are)."""
    out = []
    for leaf, node in zip(self._leaves, self._nodes):
      if leaf.path not in placed:
        out.append(node)
      elif isinstance(node, nnx.Variable):
        out.append(node.replace(placed[leaf.path]))
      else:
        out.append(placed[leaf.path])
    return jax.tree_util.tree_unflatten(self._treedef, out)


def place_logical(target: Any, mesh: Mesh, source: LogicalSource,
                  cache: ProgramCache | None = None) -> tuple[Any, set[Path]]:
  """Fill a class's state from a source of logical arrays: ``Placement(...)()``.

  Args:
    target: the class's abstract replica-stacked state (``jax.eval_shape``
      of it; ``nnx.Variable`` metadata carries the layouts).
    mesh: the class's ``('dp', 'tp')`` mesh (rows = replicas).
    source: fills the paths it has (see ``LogicalSource``).
    cache: where the programs are kept (default: a fresh ``ProgramCache``).

  Returns and raises as ``Placement.__call__`` (e.g. ``ValueError`` for an
  ``ArraySource`` array of another shape).
  """
  return Placement(target, mesh, source, cache)()


def _stack_body(dtypes: tuple[np.dtype, ...], mesh: Mesh) -> Callable[..., Any]:
  replicas = mesh.devices.shape[0]

  def stack(xs):
    return [jnp.broadcast_to(x.astype(d)[None], (replicas,) + x.shape) for x, d in zip(xs, dtypes)]

  return jax.jit(stack, out_shardings=[NamedSharding(mesh, P(DP))] * len(dtypes))


def stack_program(cache: ProgramCache, dtypes: tuple[np.dtype, ...],
                  mesh: Mesh) -> Callable[..., Any]:
  """Jitted: replicated logical arrays -> ``[replicas, ...]`` copies of ``dtypes``
  (``P('dp')``) on ``mesh``, in one program, made once per run in ``cache``."""
  return cache.program(("placement stack", dtypes, mesh), lambda: _stack_body(dtypes, mesh))


def nest(flat: dict[Path, Any]) -> dict:
  """``{("a", "b"): x}`` -> ``{"a": {"b": x}}``."""
  out: dict = {}
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


def flatten(tree: dict) -> dict[Path, Any]:
  """Inverse of ``nest`` for a nested dict whose leaves are not dicts."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update({(str(key),) + p: v for p, v in flatten(value).items()})
    else:
      out[(str(key),)] = value
  return out
