"""Uneven collectives over 'tp' against dense references (value and gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from layer_check import global_to_logical, mesh_for, split_to_global

from ntp_jax.parallel.sync_leaf import sync_layout
from ntp_jax.sharding.collectives import (
  all_gather_uneven,
  copy_shared_from_last,
  reduce_scatter_uneven,
  reshard_uneven,
  transfer_schedule,
)
from ntp_jax.sharding.layout import make_layout, owner_layout


def _slot_encoded(layout, rows=3):
  """[rows, size]: element (r, i) = 1000 * (r + 1) + logical index i."""
  return (1000.0 * (jnp.arange(rows)[:, None] + 1) + jnp.arange(layout.size)[None, :])


@pytest.mark.tp_groups()
def test_all_gather_uneven(group):
  layout = make_layout(11, group[0], failed=group[1], unit_size=2)
  x = _slot_encoded(layout)
  fn = jax.jit(jax.shard_map(lambda b: all_gather_uneven(b, layout, axis=-1), mesh=mesh_for(layout),
                     # all_gather's result is equal on every device but typed as varying.
                     in_specs=P(None, "tp"), out_specs=P(), check_vma=False))
  np.testing.assert_array_equal(fn(split_to_global(x, layout)), x)
  cot = jax.random.normal(jax.random.key(0), x.shape)
  grad = jax.grad(lambda g: jnp.sum(fn(g) * cot))(split_to_global(x, layout))
  np.testing.assert_allclose(global_to_logical(grad, layout), cot, rtol=1e-6)
  np.testing.assert_array_equal(split_to_global(global_to_logical(grad, layout), layout), grad)


@pytest.mark.tp_groups()
def test_reduce_scatter_uneven(group):
  layout = make_layout(7, group[0], failed=group[1])
  x = _slot_encoded(layout)
  # Each device contributes (position + 1) * x: the sum is x * degree (degree + 1) / 2.
  def body(xr):
    scale = (jax.lax.axis_index("tp") + 1).astype(xr.dtype)
    return reduce_scatter_uneven(xr * scale, layout, axis=-1)
  fn = jax.jit(jax.shard_map(body, mesh=mesh_for(layout), in_specs=P(), out_specs=P(None, "tp")))
  out = fn(x)
  d = layout.degree
  np.testing.assert_allclose(global_to_logical(out, layout), x * d * (d + 1) / 2, rtol=1e-6)
  np.testing.assert_array_equal(split_to_global(global_to_logical(out, layout), layout), out)
  cot = jax.random.normal(jax.random.key(1), out.shape)
  grad = jax.grad(lambda v: jnp.sum(fn(v) * cot))(x)
  # d/dx of sum_j (j+1) x: the cotangent of the logical sum, times sum of scales.
  np.testing.assert_allclose(grad, global_to_logical(cot, layout) * d * (d + 1) / 2, rtol=1e-5)


RESHARD_CASES = [
    (make_layout(8, 8), 7),  # healthy 8 -> sync layout over 7 core slots
    (make_layout(8, 8, failed=[3]), 6),
    (make_layout(50, 8, failed=[0, 7], weights=[1, 1, 3, 1, 1, 1, 1, 1]), 2),
    (make_layout(7, 8), 5),  # a zero-size slot in the source
    (make_layout(5, 3, unit_size=3), 3),  # identity
]


@pytest.mark.parametrize("src,t_min", RESHARD_CASES, ids=lambda c: str(c))
def test_reshard_to_sync_layout_and_back(src, t_min):
  dst = sync_layout(src, t_min)
  x = _slot_encoded(src)
  def body(b):
    return reshard_uneven(b, src, dst, axis=-1)
  fn = jax.jit(jax.shard_map(body, mesh=mesh_for(src), in_specs=P(None, "tp"),
                             out_specs=P(None, "tp")))
  moved = fn(split_to_global(x, src))
  np.testing.assert_array_equal(moved, split_to_global(x, dst))  # values and zero padding
  back = jax.jit(jax.shard_map(lambda b: reshard_uneven(b, dst, src, axis=-1), mesh=mesh_for(src),
                               in_specs=P(None, "tp"), out_specs=P(None, "tp")))(moved)
  np.testing.assert_array_equal(back, split_to_global(x, src))


def _simulate_schedule(blocks, src, dst):
  """numpy model of reshard_uneven: one ppermute per shift."""
  out = np.zeros((src.degree, dst.block))
  for t in transfer_schedule(src, dst):
    for i in range(src.degree):
      n = t["send_len"][i]
      if n:
        j = i + t["shift"]
        piece = blocks[i, t["send_start"][i]:t["send_start"][i] + n]
        assert t["recv_len"][j] == n
        out[j, t["recv_start"][j]:t["recv_start"][j] + n] = piece
  return out


@pytest.mark.parametrize("failed", [(), (5, 40)], ids=["healthy-72", "reduced-70"])
def test_72_and_70_slots_sync_layout_shapes_and_content(failed):
  """NVL72 domain: TP 72 beside TP 70 share a 70-slot sync layout (no devices needed)."""
  t_min = 70
  for num_units, unit_size in [(8, 128 * 4), (128256, 1), (14336 // 64, 64)]:
    src = make_layout(num_units, 72, failed=failed, unit_size=unit_size)
    dst = sync_layout(src, t_min)
    assert dst.sizes[t_min:] == (0,) * (src.degree - t_min)
    x = np.arange(src.size, dtype=np.float64)
    blocks = np.zeros((src.degree, src.block))
    for i, (o, n) in enumerate(zip(src.offsets, src.sizes)):
      blocks[i, :n] = x[o:o + n]
    moved = _simulate_schedule(blocks, src, dst)
    for j, (o, n) in enumerate(zip(dst.offsets, dst.sizes)):
      np.testing.assert_array_equal(moved[j, :n], x[o:o + n])
    # Peer-group buffers have one shape whatever the replica's degree.
    assert dst.block == sync_layout(make_layout(num_units, 72, unit_size=unit_size), t_min).block


@pytest.mark.parametrize("tp,failed", [(8, (3,)), (3, ()), (8, (0, 7))])
def test_copy_shared_from_last_equals_the_padded_blocks(tp, failed):
  """8 KV groups on 7, 3 and 6 slots: blocks holding the shared units on the last slot only
  (``owner_layout``) become, after the copy, the padded blocks of the logical array."""
  layout = make_layout(8, tp, failed=failed, unit_size=2, share_remainder=True)
  assert layout.shared_units
  x = _slot_encoded(layout)
  owned = split_to_global(x, owner_layout(layout))  # shared units once, on the last slot
  fn = jax.jit(jax.shard_map(lambda b: copy_shared_from_last(b, layout, axis=-1),
                             mesh=mesh_for(layout), in_specs=P(None, "tp"),
                             out_specs=P(None, "tp")))
  out = fn(owned)
  np.testing.assert_array_equal(out, split_to_global(x, layout))
  np.testing.assert_array_equal(global_to_logical(out, layout), x)
  # Gradient: each shared entry's cotangent, summed over the slots, lands on the last slot.
  cot = jax.random.normal(jax.random.key(1), out.shape)
  grad = jax.grad(lambda b: jnp.sum(fn(b) * cot))(owned)
  dense = jax.grad(lambda b: jnp.sum(split_to_global(global_to_logical(b, owner_layout(layout)),
                                                     layout) * cot))(owned)
  np.testing.assert_allclose(grad, dense, rtol=1e-6)
