"""Running NNX modules of padded blocks under ``jax.shard_map``.

Parameters are split by type: a ``TPParam`` is sharded over ``'tp'`` on its
leading slot axis, every other variable is replicated. ``tp_function`` turns
a function of a module into a function of its state that runs, per device,
on the local blocks (the layers' local view).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.layers.params import TPParam
from ntp_jax.sharding.blocks import from_blocks
from ntp_jax.sharding.mesh import DP, TP


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def state_specs(state: nnx.State) -> nnx.State:
  """PartitionSpec per variable: ``P('tp')`` for ``TPParam``, ``P()`` otherwise."""
  return jax.tree.map(lambda v: P(TP) if isinstance(v, TPParam) else P(), state,
                      is_leaf=_is_variable)


def replica_specs(state: nnx.State) -> nnx.State:
  """Specs of a replica-stacked state: ``P('dp', 'tp')`` for ``TPParam``, ``P('dp')`` otherwise.

  A class program keeps one copy of the parameters per DP replica, stacked on
  a leading replica axis: ``TPParam`` blocks are ``[replicas, degree, ...]``,
  replicated variables ``[replicas, ...]``. Each device holds only its own
  replica's block (the memory is that of one copy per device).
  """
  return jax.tree.map(lambda v: P(DP, TP) if isinstance(v, TPParam) else P(DP), state,
                      is_leaf=_is_variable)


def stack_replicas(state: nnx.State, replicas: int) -> nnx.State:
  """Add a leading replica axis of length ``replicas`` (copies) to every variable."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas,) + x.shape), state)


def replica_view(stacked: nnx.State, replica: int = 0) -> nnx.State:
  """One replica's copy of a replica-stacked state (leading axis removed)."""
  return jax.tree.map(lambda x: x[replica], stacked)


def unstack_local(local: nnx.State) -> nnx.State:
  """Inside ``shard_map``: drop the length-1 local replica axis of a stacked state."""
  return jax.tree.map(lambda x: x[0], local)


def restack_local(local: nnx.State) -> nnx.State:
  """Inside ``shard_map``: restore the length-1 local replica axis."""
  return jax.tree.map(lambda x: x[None], local)


def spec_shardings(specs: Any, mesh: Mesh) -> Any:
  """``NamedSharding`` for each ``PartitionSpec`` of a spec tree."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                      is_leaf=lambda x: isinstance(x, P))


def to_logical(state: nnx.State) -> dict:
  """Nested dict of logical arrays: blocks of each ``TPParam`` joined, padding dropped.

  Gathers every array where ``state`` lives: for tests and small models. The
  scalable paths (no array gathered on one device) are in ``ntp_jax.state.placement``.
  """
  def logical(v):
    if isinstance(v, TPParam):
      return from_blocks(v.get_value(), v.tp_layout, v.tp_axis)
    return v.get_value()
  return nnx.to_pure_dict(jax.tree.map(logical, state, is_leaf=_is_variable))


def tp_function(graphdef: nnx.GraphDef, state: nnx.State, fn: Callable[..., Any], mesh: Mesh,
                arg_specs: tuple, out_specs: Any) -> Callable[..., Any]:
  """``f(state, *args)`` that runs ``fn(module, *args)`` on each device's blocks.

  Args:
    graphdef: the module's graph (from ``nnx.split``).
    state: an example state (for its specs; values unused).
    fn: called inside ``shard_map`` with the merged local module.
    mesh: mesh with axes ``('dp', 'tp')``.
    arg_specs: PartitionSpec of each extra argument.
    out_specs: PartitionSpec(s) of the result.
  """
  specs = state_specs(state)

  def body(local_state, *args):
    return fn(nnx.merge(graphdef, local_state), *args)

  return jax.shard_map(body, mesh=mesh, in_specs=(specs, *arg_specs), out_specs=out_specs)


def tp_call(module: nnx.Module, mesh: Mesh, *args, arg_specs: tuple | None = None,
            out_specs: Any = P(), fn: Callable[..., Any] | None = None) -> Any:
  """Run ``fn(module, *args)`` (default ``module(*args)``) on global arrays.

  Args default to replicated (``P()``) specs.
  """
  graphdef, state = nnx.split(module)
  arg_specs = tuple(P() for _ in args) if arg_specs is None else arg_specs
  fn = fn or (lambda m, *a: m(*a))
  return jax.jit(tp_function(graphdef, state, fn, mesh, arg_specs, out_specs))(state, *args)
