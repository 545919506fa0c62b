"""Every TP layer against its dense reference, value and gradient, for TP degrees 1..8."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from flax import nnx
from jax.sharding import PartitionSpec as P
from layer_check import check_layer, global_to_logical, mesh_for, split_to_global

from ntp_jax.layers import (
  Attention,
  ColumnParallelLinear,
  RMSNorm,
  RowParallelLinear,
  SwiGLU,
  VocabParallelEmbed,
  apply_rope,
  rope_angles,
  vocab_parallel_cross_entropy,
)
from ntp_jax.layers.shard import tp_call
from ntp_jax.sharding.layout import make_layout

B, S = 2, 5


def _x(shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.tp_groups()
def test_column_parallel_linear(group):
  layout = make_layout(11, group[0], failed=group[1])
  layer = ColumnParallelLinear(6, layout, rngs=nnx.Rngs(0))
  check_layer(layer, (_x((B, S, 6)),), (P(),), P(None, None, "tp"),
              lambda p, x: x @ p["kernel"], out_layout=layout, grad_args=(0,))


@pytest.mark.tp_groups()
def test_row_parallel_linear(group):
  layout = make_layout(11, group[0], failed=group[1])
  layer = RowParallelLinear(layout, 6, rngs=nnx.Rngs(0))
  x = _x((B, S, 11))
  check_layer(layer, (split_to_global(x, layout),), (P(None, None, "tp"),), P(),
              lambda p, xg: global_to_logical(xg, layout) @ p["kernel"], grad_args=(0,))


@pytest.mark.tp_groups()
def test_swiglu(group):
  layout = make_layout(9, group[0], failed=group[1], unit_size=2)  # d_ff 18 in units of 2
  layer = SwiGLU(6, layout, rngs=nnx.Rngs(1))
  check_layer(layer, (_x((B, S, 6)),), (P(),), P(), lambda p, x: ref.swiglu(x, p), grad_args=(0,))


def test_swiglu_d_ff_5_on_2_slots():
  layout = make_layout(5, 2)
  assert layout.sizes == (3, 2)
  check_layer(SwiGLU(4, layout, rngs=nnx.Rngs(2)), (_x((B, S, 4)),), (P(),), P(),
              lambda p, x: ref.swiglu(x, p), grad_args=(0,))


@pytest.mark.tp_groups()
def test_attention(group):
  n_heads, head_dim = 12, 4
  layout = make_layout(6, group[0], failed=group[1])  # 6 KV heads, group of 2
  layer = Attention(10, n_heads, head_dim, layout, rngs=nnx.Rngs(3))
  check_layer(layer, (_x((B, S, 10)),), (P(),), P(),
              lambda p, x: ref.attention(x, p, n_heads, 6, head_dim, 10_000.0),
              fn=_attention_fn(head_dim, 10_000.0), grad_args=(0,))


def test_attention_16_heads_8_kv_on_3_slots():
  layout = make_layout(8, 3)
  assert layout.units == (3, 3, 2) and layout.with_unit_size(2).sizes == (6, 6, 4)
  layer = Attention(12, 16, 4, layout, rngs=nnx.Rngs(4))
  assert layer.wq[...].shape == (3, 12, 3 * 2 * 4)
  check_layer(layer, (_x((B, 7, 12)),), (P(),), P(),
              lambda p, x: ref.attention(x, p, 16, 8, 4, 500_000.0),
              fn=_attention_fn(4, 500_000.0), grad_args=(0,))


def _attention_fn(head_dim, theta):
  def fn(m, x):
    cos, sin = rope_angles(jnp.arange(x.shape[1])[None], head_dim, theta)
    return m(x, cos, sin)
  return fn


@pytest.mark.tp_groups()
def test_vocab_parallel_embedding(group):
  layout = make_layout(13, group[0], failed=group[1])
  layer = VocabParallelEmbed(layout, 6, rngs=nnx.Rngs(5))
  ids = jnp.array([[0, 12, 5, 6, 1], [11, 3, 3, 7, 2]], jnp.int32)
  check_layer(layer, (ids,), (P(),), P(), lambda p, i: p["embedding"][i])


def test_vocab_parallel_embedding_50257_on_7_slots():
  layout = make_layout(50257, 7)
  layer = VocabParallelEmbed(layout, 4, rngs=nnx.Rngs(6))
  ids = jnp.array([[0, 50256, 7179, 7180, 7181, 25000, 43077, 43078]], jnp.int32)
  check_layer(layer, (ids,), (P(),), P(), lambda p, i: p["embedding"][i])


class _Logits(nnx.Module):
  """Wraps split logits as a TPParam so check_layer differentiates them."""

  def __init__(self, logits, layout):
    from ntp_jax.layers.params import TPParam
    from ntp_jax.sharding.blocks import to_blocks
    self.logits = TPParam(to_blocks(logits, layout, -1), tp_layout=layout, tp_axis=logits.ndim - 1)


def _cross_entropy_fn(layout):
  def fn(m, labels):
    return vocab_parallel_cross_entropy(m.logits[...][0], labels, layout)
  return fn


def test_cross_entropy_pinned_values():
  layout = make_layout(4, 2)
  module = _Logits(jnp.array([0.0, 1.0, 2.0, 3.0]), layout)
  labels = jnp.array(3)
  loss = tp_call(module, mesh_for(layout), labels, fn=_cross_entropy_fn(layout))
  np.testing.assert_allclose(loss, 0.4401897, rtol=1e-6)
  from ntp_jax.layers.shard import to_logical
  grad = jax.grad(lambda m: tp_call(m, mesh_for(layout), labels, fn=_cross_entropy_fn(layout)))(
      module)
  np.testing.assert_allclose(to_logical(nnx.state(grad))["logits"],
                             [0.0320586, 0.0871443, 0.2368828, -0.3560858], atol=2e-6)


@pytest.mark.tp_groups(extra=[(8, (1, 2, 3, 4, 5, 6, 7))])
def test_cross_entropy(group):
  layout = make_layout(7, group[0], failed=group[1])  # 7 rows: uneven, some slots empty at 8
  logits = 3 * _x((B, S, 7), seed=7)
  labels = jax.random.randint(jax.random.key(8), (B, S), 0, 7)
  check_layer(_Logits(logits, layout), (labels,), (P(),), P(),
              lambda p, y: ref.cross_entropy(p["logits"], y), fn=_cross_entropy_fn(layout))


def test_cross_entropy_7_rows_over_8_slots_and_50257_on_7():
  for layout, vocab in [(make_layout(7, 8), 7), (make_layout(50257, 7), 50257)]:
    logits = 4 * _x((1, 3, vocab), seed=9)
    labels = jnp.array([[0, vocab - 1, vocab // 2]])
    check_layer(_Logits(logits, layout), (labels,), (P(),), P(),
                lambda p, y: ref.cross_entropy(p["logits"], y), fn=_cross_entropy_fn(layout))


def test_cross_entropy_padding_gets_no_mass():
  # Padded logits would dominate if they leaked: the real logits are very negative.
  layout = make_layout(3, 2)  # sizes 2, 1: slot 1 has one padded entry
  logits = jnp.array([[-50.0, -60.0, -55.0]])
  module = _Logits(logits, layout)
  labels = jnp.array([0])
  loss = tp_call(module, mesh_for(layout), labels, fn=_cross_entropy_fn(layout))
  np.testing.assert_allclose(loss, ref.cross_entropy(logits, labels), rtol=1e-6)


def test_rmsnorm_and_rope_match_reference():
  x = _x((B, S, 8))
  norm = RMSNorm(8, eps=1e-5)
  norm.scale[...] = jnp.arange(1.0, 9.0)
  np.testing.assert_allclose(norm(x), ref.rmsnorm(x, jnp.arange(1.0, 9.0), 1e-5), rtol=1e-5)
  q = _x((B, S, 3, 8), seed=1)
  cos, sin = rope_angles(jnp.arange(S)[None], 8, 10_000.0)
  np.testing.assert_allclose(apply_rope(q, cos, sin), ref.rope(q, 10_000.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", ["column", "mlp", "attention"])
def test_layer_called_outside_shard_map_is_a_clear_error(block):
  x = jnp.ones((1, 2, 4))
  if block == "column":
    call = lambda: ColumnParallelLinear(4, make_layout(4, 2), rngs=nnx.Rngs(0))(x)  # noqa: E731
  elif block == "mlp":
    call = lambda: SwiGLU(4, make_layout(4, 2), rngs=nnx.Rngs(0))(x)  # noqa: E731
  else:
    cos, sin = rope_angles(jnp.arange(2)[None], 2, 1e4)
    call = lambda: Attention(4, 4, 2, make_layout(2, 2), rngs=nnx.Rngs(0))(x, cos, sin)  # noqa: E731
  with pytest.raises(ValueError, match="outside shard_map"):
    call()


@pytest.mark.parametrize("rows,seq", [(3, 7), (4, 6), (1, 7), (2, 2)])
def test_attention_with_shared_kv_groups_on_positions(rows, seq):
  """8 KV groups on 3 slots as 2 each + 2 shared, computed on each slot's run of positions:
  runs of 3 that divide the sequence (6), a last run moved back over its neighbour's (7),
  and a slot with no position of its own (2)."""
  layout = make_layout(8, 3, share_remainder=True)
  assert layout.units == (2, 2, 2) and layout.shared_units == 2 and layout.block_units == 4
  layer = Attention(12, 16, 4, layout, rngs=nnx.Rngs(4))
  check_layer(layer, (_x((rows, seq, 12)),), (P(),), P(),
              lambda p, x: ref.attention(x, p, 16, 8, 4, 500_000.0),
              fn=_attention_fn(4, 500_000.0), grad_args=(0,))


def test_shared_kv_groups_do_less_work_per_device_than_padding():
  from ntp_jax.analysis.cost import compiled_flops
  from ntp_jax.layers.shard import tp_function
  flops = {}
  for share in (False, True):
    layout = make_layout(8, 3, share_remainder=share)
    layer = Attention(64, 16, 16, layout, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    run = tp_function(graphdef, state, _attention_fn(16, 1e4), mesh_for(layout), (P(),), P())
    flops[share] = compiled_flops(jax.jit(run).lower(state, _x((6, 32, 64))))
  # 2 own + 2 shared on a third of the positions = 2.67 groups of work, against 3 padded.
  assert flops[True] < 0.95 * flops[False], flops


def test_a_shared_kv_group_costs_each_slot_one_degree_th_of_a_group():
  """8 KV groups on 7 slots (1 each + 1 shared) on 3 rows, which do not divide by 7: the
  shared group is split by position, so each device does 8/7 of a healthy device's work
  (a split by rows would compute 7 rows for 3)."""
  from ntp_jax.analysis.cost import compiled_flops
  from ntp_jax.layers.shard import tp_function
  flops = {}
  for failed in ((), (3,)):
    layout = make_layout(8, 8, failed=failed, share_remainder=True)
    layer = Attention(64, 16, 16, layout, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    run = tp_function(graphdef, state, _attention_fn(16, 1e4), mesh_for(layout), (P(),), P())
    loss = lambda s, x, run=run: jnp.sum(run(s, x))  # noqa: E731
    flops[len(failed)] = compiled_flops(jax.jit(jax.grad(loss)).lower(state, _x((3, 28, 64))))
  assert flops[1] / flops[0] == pytest.approx(8 / 7, rel=0.01), flops
