"""A scanned layer stack rematerialised in full, with its saved values and stacks as bits.

``remat_scan(apply, x, per_layer, args)`` computes what
``jax.lax.scan(jax.checkpoint(apply, policy=nothing_saveable), ...)`` computes, value and
gradient, bit for bit: the forward pass keeps each layer's input only, and the backward
pass runs the layers in reverse, recomputing each from its input (``jax.vjp``) before
taking its gradient. It writes that backward pass itself so that every stacked array
that crosses the loop (the layers' inputs, the parameters, their gradients) does so
as unsigned integers of its width when its dtype is narrower than 32 bits.

Why: XLA's CPU compiler has no bfloat16 matmuls and widens them to float32; its
simplifier then moves the widening out of the loop onto the whole stack
(``convert(dynamic_slice(w)) -> dynamic_slice(convert(w))``), so a bfloat16 model kept a
float32 copy of every stacked parameter, of the saved layer inputs and of the stacked
gradients beside the bfloat16 ones: measured, Llama-3-70B's 16-layer stand-in at TP 8
grew by 0.85 GiB per layer in temporaries; through this scan, by 0.52. Slices of integers
cannot be widened, so each layer's values are widened inside the loop, one layer at a time.
The bit casts of whole stacks are not free there: XLA's CPU compiler writes each as a copy
(the parameter stack once, the gradient stack once), still half of a float32 twin. An
``optimization_barrier`` on each slice instead of the casts kept the float32 stacks, and
slicing with a gather did too. (Measured with ``footprint.class_footprints`` on
``configs/gpt_70b.py`` at 8 and 16 layers; see docs/scale.md.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def _narrow(dtype) -> bool:
  dtype = jnp.dtype(dtype)
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4


def _to_bits(tree):
  return jax.tree.map(
      lambda a: jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{8 * a.dtype.itemsize}"))
      if _narrow(a.dtype) else a, tree)


def _from_bits(tree, like):
  return jax.tree.map(
      lambda a, ref: jax.lax.bitcast_convert_type(a, ref.dtype) if _narrow(ref.dtype) else a,
      tree, like)


def _one_layer(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)


def remat_scan(apply: Callable[..., jax.Array], x: jax.Array, per_layer: Any,
               args: tuple = ()) -> jax.Array:
  """``x = apply(x, layer, *args)`` for each layer of ``per_layer`` (leading layer axis), in
  order, with full rematerialisation.

  Args:
    apply: one layer, ``(x, layer_params, *args) -> x`` (same shape and dtype).
    x: the carried activation.
    per_layer: a pytree of arrays, each with the layer axis first.
    args: arrays passed unchanged to every layer (e.g. RoPE tables). They are constants:
      no gradient flows to them (their cotangent is zero).

  Returns:
    The last layer's output. Its gradient with respect to ``x`` and ``per_layer`` equals
    ``jax.lax.scan`` over ``jax.checkpoint(apply, policy=nothing_saveable)``'s, bit for bit
    on the backends tested (``tests/ops/test_remat_scan.py``).
  """
  args = tuple(jax.lax.stop_gradient(a) for a in args)
  x_like = jax.ShapeDtypeStruct(x.shape, x.dtype)
  stack_like = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), per_layer)
  layer_like = _one_layer(per_layer)

  @jax.custom_vjp
  def run(x, per_layer, args):
    return jax.lax.scan(lambda h, layer: (apply(h, layer, *args), None), x, per_layer)[0]

  def forward(x, per_layer, args):
    def step(h, layer_bits):
      return apply(h, _from_bits(layer_bits, layer_like), *args), _to_bits(h)

    bits = _to_bits(per_layer)
    y, inputs = jax.lax.scan(step, x, bits)
    return y, (inputs, bits, args)

  def backward(saved, dy):
    inputs, bits, args = saved

    def step(dh, saved_layer):
      h_bits, layer_bits = saved_layer
      _, vjp = jax.vjp(lambda h, layer: apply(h, layer, *args),
                       _from_bits(h_bits, x_like), _from_bits(layer_bits, layer_like))
      dh, dlayer = vjp(dh)
      return dh, _to_bits(dlayer)

    dx, dbits = jax.lax.scan(step, dy, (inputs, bits), reverse=True)
    return dx, _from_bits(dbits, stack_like), jax.tree.map(jnp.zeros_like, args)

  run.defvjp(forward, backward)
  return run(x, per_layer, args)
