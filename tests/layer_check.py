"""Shared checker: a TP layer against its dense reference, value and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ntp_jax.layers import TPParam
from ntp_jax.layers.shard import to_logical, tp_function
from ntp_jax.sharding.blocks import from_blocks, to_blocks
from ntp_jax.sharding.layout import Layout
from ntp_jax.sharding.mesh import class_mesh

RTOL, ATOL = 2e-5, 2e-6


def mesh_for(layout: Layout):
  return class_mesh([0], [layout.live_slots], layout.tp)


def split_to_global(x, layout, axis=-1):
  """Logical [..., size] -> global [..., degree * block] (blocks side by side), for P(.., 'tp')."""
  blocks = to_blocks(x, layout, axis)  # [degree, ..., block]
  moved = jnp.moveaxis(blocks, 0, axis % x.ndim)  # [..., degree, block]
  return moved.reshape(moved.shape[:axis % x.ndim] + (-1,))


def global_to_logical(y, layout):
  """Global [..., degree * block] -> logical [..., size]."""
  blocks = jnp.moveaxis(y.reshape(y.shape[:-1] + (layout.degree, layout.block)), -2, 0)
  return from_blocks(blocks, layout, -1)


def sum_shared_global(state):
  """Global-array form of ``sum_shared_grads``: add shared-unit gradients over the slot axis."""
  def total(v):
    if not isinstance(v, TPParam) or not v.tp_layout.shared_units:
      return v
    layout, axis = v.tp_layout, 1 + v.tp_axis
    g = v.get_value()
    start = layout.own_size
    shared = jax.lax.slice_in_dim(g, start, layout.block, axis=axis)
    shared = jnp.broadcast_to(shared.sum(axis=0, keepdims=True), shared.shape)
    return v.replace(jnp.concatenate([jax.lax.slice_in_dim(g, 0, start, axis=axis), shared],
                                     axis=axis))
  return jax.tree.map(total, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def assert_padding_zero(state):
  """Every TPParam's padded entries are exactly zero."""
  for path, v in nnx.to_flat_state(state):
    if isinstance(v, TPParam):
      value = v[...]
      repadded = to_blocks(from_blocks(value, v.tp_layout, v.tp_axis), v.tp_layout, v.tp_axis)
      np.testing.assert_array_equal(repadded, value, err_msg=f"nonzero padding in {path}")


def check_layer(module, args, arg_specs, out_spec, reference, *, out_layout=None, fn=None,
                grad_args=(), seed=0):
  """Forward and gradient of ``fn(module, *args)`` under shard_map against ``reference``.

  Args:
    module: an NNX module with at least one ``TPParam``; the first one's
      layout gives the mesh (``mesh_for``).
    args: the layer's arguments as global arrays (a split input as
      ``split_to_global(x, layout)``).
    arg_specs: one ``PartitionSpec`` per entry of ``args``.
    out_spec: ``PartitionSpec`` of the layer's output.
    reference: ``reference(logical_params, *args)``, the dense result, given
      the module's parameters in logical form (``ntp_jax.layers.shard.to_logical``)
      and the *same* ``args`` as the layer: it converts a split argument to
      logical form itself (``global_to_logical``), so the gradients of
      ``grad_args`` compare like for like.
    out_layout: the layout of a split output (column-parallel), else None;
      the output is compared in logical form and its padding must be zero.
    fn: ``fn(module, *args)``, what to run; default ``module(*args)``.
    grad_args: indices of ``args`` (floats) whose gradients are compared too.
    seed: the cotangent is drawn from ``jax.random.key(seed + 1)``.

  Returns:
    The layer's global output.

  Raises:
    ValueError: ``module`` has no ``TPParam``.
    AssertionError: a value or gradient differs, or a gradient's padding is not zero.
  """
  layout = _any_layout(module)
  mesh = mesh_for(layout)
  graphdef, state = nnx.split(module)
  fn = fn or (lambda m, *a: m(*a))
  run = tp_function(graphdef, state, fn, mesh, arg_specs, out_spec)
  to_logical_out = (lambda y: global_to_logical(y, out_layout)) if out_layout else (lambda y: y)

  out = jax.jit(run)(state, *args)
  logical = to_logical(state)
  expected = jax.jit(reference)(logical, *args)  # compiled: op by op takes seconds
  np.testing.assert_allclose(to_logical_out(out), expected, rtol=RTOL, atol=ATOL)
  if out_layout is not None:
    # The padded output columns are zero.
    np.testing.assert_array_equal(split_to_global(to_logical_out(out), out_layout), out)

  cotangent = jax.random.normal(jax.random.key(seed + 1), expected.shape, expected.dtype)
  argnums = (0,) + tuple(1 + i for i in grad_args)
  grads = jax.jit(jax.grad(lambda s, *a: jnp.sum(to_logical_out(run(s, *a)) * cotangent),
                           argnums=argnums))(state, *args)
  ref_grads = jax.jit(jax.grad(lambda p, *a: jnp.sum(reference(p, *a) * cotangent),
                               argnums=argnums))(logical, *args)
  layer_grads = sum_shared_global(grads[0])
  assert_padding_zero(layer_grads)
  got = to_logical(layer_grads)
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5), got,
               ref_grads[0])
  for g, r in zip(grads[1:], ref_grads[1:]):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
  return out


def _any_layout(module):
  for _, v in nnx.to_flat_state(nnx.state(module)):
    if isinstance(v, TPParam):
      return v.tp_layout
  raise ValueError("module has no TPParam")
