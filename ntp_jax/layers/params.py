"""Parameters stored as padded per-slot blocks.

``TPParam`` marks an ``nnx.Param`` whose leading axis is the live slots of a
TP group (sharded over the mesh's ``'tp'`` axis, one block per device). Its
metadata records how to read it back: ``tp_layout`` (the ``Layout``) and
``tp_axis`` (which logical axis is split). Plain ``nnx.Param``s are replicated
over the TP group (norm scales).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ntp_jax.sharding.blocks import to_blocks
from ntp_jax.sharding.collectives import tp_sum
from ntp_jax.sharding.layout import Layout

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


class TPParam(nnx.Param):
  """A parameter held as ``[degree, *logical_shape]`` padded blocks (split axis -> block)."""


def tp_param(rngs: nnx.Rngs, init: Initializer, logical_shape: tuple[int, ...],
             layout: Layout, axis: int, dtype: jnp.dtype) -> TPParam:
  """Initialise a logical array, then store it as padded blocks.

  The logical array is drawn first so that every layout (any TP degree,
  any failed slot) starts from the same logical values for the same seed.
  """
  logical = init(rngs.params(), logical_shape, dtype)
  axis = axis % len(logical_shape)
  return TPParam(to_blocks(logical, layout, axis), tp_layout=layout, tp_axis=axis)


def local_block(param: nnx.Variable) -> jax.Array:
  """This device's block of a ``TPParam`` (call inside a ``shard_map`` body).

  Raises:
    ValueError: the parameter still has its global slot axis, i.e. the layer
      was called outside ``shard_map`` (use ``ntp_jax.layers.shard.tp_call``).
  """
  value = param[...]
  if value.shape[0] != 1:
    raise ValueError(
        f"layer called outside shard_map: parameter has {value.shape[0]} slot blocks, "
        "expected this device's one; run it through ntp_jax.layers.shard.tp_call")
  return value[0]


def sum_shared_grads(grads: nnx.State) -> nnx.State:
  """Inside a ``shard_map`` body: add the gradients of shared units over the TP group.

  Each slot computes shared units (``Layout.shared_units``) on its own run
  of sequence positions (``layers.attention``), so its gradient there is a
  partial sum; after this every slot holds the full gradient of its copy,
  and the copies stay identical.
  """
  def total(v):
    if not isinstance(v, TPParam) or not v.tp_layout.shared_units:
      return v
    layout = v.tp_layout
    g, axis = v.get_value(), 1 + v.tp_axis
    start = layout.own_size
    own = jax.lax.slice_in_dim(g, 0, start, axis=axis)
    shared = jax.lax.slice_in_dim(g, start, layout.block, axis=axis)
    return v.replace(jnp.concatenate([own, tp_sum(shared)], axis=axis))
  return jax.tree.map(total, grads, is_leaf=lambda x: isinstance(x, nnx.Variable))
