"""``remat_scan`` against ``jax.lax.scan`` over ``jax.checkpoint(nothing_saveable)``: the same
output and gradients, bit for bit, in bfloat16 and float32, on sizes that do not divide; and
on the CPU compiler, no float32 copy of a bfloat16 parameter stack in the gradient program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntp_jax.layers.remat_scan import remat_scan

LAYERS, ROWS, WIDTH, HIDDEN = 5, 3, 7, 11  # none divides another


def layer(x, params, scale):
  """A small residual MLP whose output depends on every input, parameter and ``scale``."""
  h = jnp.tanh(x @ params["up"] + params["bias"]) * scale
  return x + h @ params["down"]


def inputs(dtype):
  """Values that encode their slot (layer, row, column), so a misplaced layer or transposed
  gradient changes the result."""
  def ramp(*shape, base):
    i = np.arange(np.prod(shape)).reshape(shape)
    return jnp.asarray(np.sin(base + 0.37 * i) / np.sqrt(shape[-1]), dtype)

  params = {"up": ramp(LAYERS, WIDTH, HIDDEN, base=1.0), "bias": ramp(LAYERS, HIDDEN, base=2.0),
            "down": ramp(LAYERS, HIDDEN, WIDTH, base=3.0)}
  return ramp(ROWS, WIDTH, base=0.0), params, ramp(HIDDEN, base=4.0)


def reference(x, params, scale):
  checkpointed = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)
  return jax.lax.scan(lambda h, p: (checkpointed(h, p, scale), None), x, params)[0]


def ours(x, params, scale):
  return remat_scan(layer, x, params, (scale,))


def loss_and_grads(run, x, params, scale):
  def loss(x, params):
    out = run(x, params, scale)
    return jnp.sum(out.astype(jnp.float32) * jnp.arange(out.size).reshape(out.shape))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, params)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_value_and_gradients_equal_the_checkpointed_scan_bit_for_bit(dtype):
  x, params, scale = inputs(dtype)
  want = loss_and_grads(reference, x, params, scale)
  got = loss_and_grads(ours, x, params, scale)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(b.astype(jnp.float32)),
                                  np.asarray(a.astype(jnp.float32)))
  assert float(jnp.abs(got[1][1]["up"].astype(jnp.float32)).min()) > 0  # every slot reached


def test_the_constant_arguments_get_a_zero_gradient():
  x, params, scale = inputs(jnp.float32)
  grad = jax.grad(lambda s: jnp.sum(ours(x, params, s)))(scale)
  np.testing.assert_array_equal(np.asarray(grad), np.zeros(HIDDEN))


def test_no_float32_copy_of_a_bfloat16_stack_on_cpu():
  """The checkpointed scan's gradient program holds ``f32[LAYERS,WIDTH,HIDDEN]`` (the widened
  ``up`` stack, hoisted out of the loop by the CPU compiler); ours widens one layer at a
  time."""
  x, params, scale = inputs(jnp.bfloat16)
  stack = f"f32[{LAYERS},{WIDTH},{HIDDEN}]"

  def program(run):
    grad = jax.grad(lambda p: jnp.sum(run(x, p, scale).astype(jnp.float32)))
    return jax.jit(grad).lower(params).compile().as_text()

  if stack not in program(reference):
    pytest.skip("this compiler keeps no float32 stack for the checkpointed scan either")
  assert stack not in program(ours)
