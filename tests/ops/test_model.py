"""The whole GPT against a dense single-device reference, value and gradient (tied embeddings,
the other plans, one initialisation on every layout: ``tests/plans/test_model_plans.py``)."""

import jax
import numpy as np
import pytest
import reference as ref
from flax import nnx
from layer_check import assert_padding_zero

from models.gpt import GPT, GPTConfig, count_params, model_layouts
from ntp_jax.layers.shard import replica_view, to_logical
from ntp_jax.parallel.programs import abstract_params, init_stacked_params
from ntp_jax.parallel.steps import make_loss_and_grad
from ntp_jax.sharding.mesh import class_mesh

# Sizes that do not divide: 8 KV heads, 16 query heads, d_ff 20 in units of 4, vocabulary 37.
CFG = GPTConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=4,
                d_ff=20, ffn_granularity=4, rope_theta=10_000.0)


def _batch(cfg, rows, seq, seed=0):
  return jax.random.randint(jax.random.key(seed), (rows, seq + 1), 0, cfg.vocab_size)


@pytest.mark.tp_groups(fast=[(8, (3,))])
def test_gpt_loss_and_gradient_match_dense_reference(group):
  tp, failed = group
  layouts = model_layouts(CFG, tp, failed)
  mesh = class_mesh([0], [layouts.heads.live_slots], tp)
  graphdef, params = init_stacked_params(lambda: GPT(CFG, layouts, rngs=nnx.Rngs(0)), mesh, 1)
  batch = _batch(CFG, 3, 6)
  step = make_loss_and_grad(graphdef, params, mesh, batch[:, 1:].size)
  loss, grads = jax.jit(step)(params, batch)
  params, grads = replica_view(params), replica_view(grads)

  logical = to_logical(params)
  ref_loss, ref_grads = ref.gpt_loss_and_grad(logical, batch[:, :-1], batch[:, 1:], CFG)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  assert_padding_zero(grads)
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6),
               to_logical(grads), ref_grads)
  # Per-device shards have the padded-block shape.
  kernel = params["blocks"]["mlp"]["gate"]["kernel"].get_value()
  assert {s.data.shape for s in kernel.addressable_shards} == {
      (1, CFG.n_layers, 16, layouts.ffn.block)}


def test_unknown_remat_policy_names_the_field():
  import dataclasses

  from ntp_jax.errors import ConfigError
  with pytest.raises(ConfigError, match="model.remat: unknown policy 'ful'"):
    dataclasses.replace(CFG, remat="ful")


def test_logical_arrays_placed_into_blocks_with_shared_units():
  import optax

  from ntp_jax.parallel.programs import abstract_class_state
  from ntp_jax.state.placement import flatten, place_logical
  from ntp_jax.state.sources import ArraySource
  layouts = model_layouts(CFG, 8, (3,))  # 8 KV heads on 7 slots: 1 each + 1 shared
  assert layouts.heads.shared_units == 1
  state = nnx.state(GPT(CFG, layouts, rngs=nnx.Rngs(5)))
  logical = {("params",) + p: v for p, v in flatten(to_logical(state)).items()}
  mesh = class_mesh([0], [layouts.heads.live_slots], 8)
  _, target = abstract_class_state(lambda: GPT(CFG, layouts, rngs=nnx.Rngs(6)), 1, optax.sgd(1.0))
  placed, filled = place_logical({"params": target["params"]}, mesh, ArraySource(logical))
  assert filled == set(logical)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a)[0], b),
               jax.tree.leaves(placed["params"]), jax.tree.leaves(state))
  bad = dict(logical)
  bad[("params", "embed", "embedding")] = logical[("params", "embed", "embedding")][:-1]
  with pytest.raises(ValueError, match=r"params/embed/embedding: shape \(36, 16\), "
                                       r"expected \(37, 16\)"):
    place_logical({"params": target["params"]}, mesh, ArraySource(bad))


def test_gpt_8b_shapes_and_parameter_count_without_allocating():
  import configs.gpt_8b
  cfg = GPTConfig.from_config(configs.gpt_8b.get_config().model)
  assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size) == (
      32, 4096, 32, 8, 14336, 128256)
  layouts = model_layouts(cfg, 8, failed=(3,))
  params = abstract_params(lambda: GPT(cfg, layouts, rngs=nnx.Rngs(0)))
  logical = jax.eval_shape(to_logical, params)
  n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(logical))
  assert n == count_params(cfg)
  assert abs(n - 8.03e9) < 0.005e9, n
  # 8 KV heads on 7 slots: a padded block of 2 groups (4 query heads each, head_dim 128).
  assert params["blocks"]["attn"]["wq"].get_value().shape == (7, 32, 4096, 2 * 4 * 128)
  assert params["blocks"]["mlp"]["gate"]["kernel"].get_value().shape == (7, 32, 4096, 2048)
