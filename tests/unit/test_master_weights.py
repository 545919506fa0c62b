"""``parallel.master_weights``: AdamW stepped on float32 master weights of bfloat16 parameters."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ntp_jax.parallel.master_weights import MasterWeightsState, with_master_weights


def test_float32_parameters_keep_the_inner_state():
  inner = optax.adamw(1e-2)
  params = {"w": jnp.ones((3,), jnp.float32)}
  state = with_master_weights(inner).init(params)
  assert jax.tree.structure(state) == jax.tree.structure(inner.init(params))


def test_bfloat16_parameters_are_the_float32_run_rounded():
  """Five steps: the master weights follow AdamW on float32 parameters fed the same
  (bfloat16) gradients exactly, and the parameters are those master weights rounded."""
  inner = optax.adamw(3e-3, weight_decay=0.1)
  wrapped = with_master_weights(inner)
  start = jnp.linspace(-1.0, 1.0, 37, dtype=jnp.float32)
  params = {"w": start.astype(jnp.bfloat16)}
  reference = {"w": params["w"].astype(jnp.float32)}
  state, ref_state = wrapped.init(params), inner.init(reference)
  assert isinstance(state, MasterWeightsState) and state.master["w"].dtype == jnp.float32
  for step in range(5):
    grads = {"w": jnp.sin(start * (step + 1)).astype(jnp.bfloat16)}
    updates, state = wrapped.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    ref_updates, ref_state = inner.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads),
                                          ref_state, reference)
    reference = optax.apply_updates(reference, ref_updates)
    np.testing.assert_array_equal(state.master["w"], reference["w"])
    np.testing.assert_array_equal(params["w"], reference["w"].astype(jnp.bfloat16))
    assert params["w"].dtype == jnp.bfloat16
  # The steps moved the parameters by less than a bfloat16 rounding in places: the float32
  # copy is what keeps them.
  assert not np.array_equal(np.asarray(reference["w"]),
                            np.asarray(params["w"].astype(jnp.float32)))
