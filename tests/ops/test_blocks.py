"""Logical <-> padded blocks: exact round trip, zero padding, slot-encoded values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntp_jax.sharding.blocks import from_blocks, pad_mask, to_blocks
from ntp_jax.sharding.layout import make_layout

LAYOUTS = [
    make_layout(5, 2),  # d_ff 5 on 2 slots
    make_layout(8, 3, unit_size=2),  # 16 query heads on 3 slots
    make_layout(7, 8),  # 7 rows over 8 slots, one slot empty
    make_layout(8, 8, failed=[3]),
    make_layout(6, 5, failed=[0, 4], weights=[1, 1, 3, 1, 1]),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.describe())
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_round_trip_and_padding(layout, axis):
  shape = [3, 4, 2]
  shape[axis] = layout.size
  # Each element encodes its logical index along the split axis (+1, so 0 means padding).
  index = jnp.arange(1, layout.size + 1, dtype=jnp.float32)
  expand = [None] * 3
  expand[axis] = slice(None)
  x = jnp.broadcast_to(index[tuple(expand)], shape) + 1000 * jax.random.uniform(
      jax.random.key(0), shape)
  blocks = to_blocks(x, layout, axis)
  block_axis = (axis % 3) + 1
  assert blocks.shape[0] == layout.degree and blocks.shape[block_axis] == layout.block
  np.testing.assert_array_equal(from_blocks(blocks, layout, axis), x)
  # Slot i's block holds exactly its logical run, then zeros.
  moved = np.moveaxis(np.asarray(blocks), block_axis, 1)  # [degree, block, ...]
  for i, (offset, size) in enumerate(zip(layout.offsets, layout.sizes)):
    along = np.moveaxis(np.asarray(x), axis, 0)
    np.testing.assert_array_equal(moved[i, :size], along[offset:offset + size])
    assert np.all(moved[i, size:] == 0)
  assert pad_mask(layout).sum() == layout.size


def test_gradient_of_round_trip_is_identity_and_zero_in_padding():
  layout = make_layout(7, 4, failed=[2])
  x = jnp.arange(7.0 * 3).reshape(7, 3)
  grad = jax.grad(lambda b: jnp.sum(from_blocks(b, layout, 0) * x))(to_blocks(x, layout, 0))
  np.testing.assert_array_equal(from_blocks(grad, layout, 0), x)
  assert np.all(np.asarray(grad)[~pad_mask(layout)] == 0)


def test_shape_mismatch_is_a_clear_error():
  with pytest.raises(ValueError, match="layout expects 5"):
    to_blocks(jnp.zeros((4, 3)), make_layout(5, 2), 0)
  with pytest.raises(ValueError, match="2 live slots"):
    from_blocks(jnp.zeros((3, 3)), make_layout(5, 2), 0)
