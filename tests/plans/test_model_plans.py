"""The GPT checks of ``tests/ops/test_model.py`` on the other TP plans, tied embeddings, the same
logical initialisation on every layout, scanned, unrolled and
rematerialised blocks, and padding that stays zero through optimizer steps (SGD and two
classes)."""

import dataclasses

import jax
import numpy as np
import pytest
import reference as ref
from flax import nnx
from helpers import run_job
from layer_check import assert_padding_zero
from ops.test_model import (  # noqa: F401  (collected here on the other plans)
  CFG,
  _batch,
  test_gpt_loss_and_gradient_match_dense_reference,
)

from models.gpt import GPT, count_params, model_layouts
from ntp_jax.layers.shard import replica_view, to_logical
from ntp_jax.parallel.programs import init_stacked_params
from ntp_jax.parallel.steps import make_loss_and_grad
from ntp_jax.sharding.mesh import class_mesh


@pytest.mark.parametrize("scan,remat", [(True, "full"), (False, "none"),
                                        (True, "dots_with_no_batch_dims_saveable")])
def test_scanned_unrolled_and_rematerialised_blocks_match_dense_reference(scan, remat):
  cfg = dataclasses.replace(CFG, n_layers=3, scan_layers=scan, remat=remat)
  layouts = model_layouts(cfg, 8, (3,))  # 7 live slots: uneven heads (1 shared), MLP, vocab
  mesh = class_mesh([0], [layouts.heads.live_slots], 8)
  graphdef, params = init_stacked_params(lambda: GPT(cfg, layouts, rngs=nnx.Rngs(1)), mesh, 1)
  batch = _batch(cfg, 5, 6, seed=2)
  step = make_loss_and_grad(graphdef, params, mesh, batch[:, 1:].size)
  loss, grads = jax.jit(step)(params, batch)
  logical = to_logical(replica_view(params))
  # Each layer drew its own weights.
  wq = logical["blocks"]["attn"]["wq"]
  assert wq.shape == (3, 16, 64) and not np.allclose(wq[0], wq[1])
  ref_loss, ref_grads = ref.gpt_loss_and_grad(logical, batch[:, :-1], batch[:, 1:], cfg)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6),
               to_logical(replica_view(grads)), ref_grads)



def test_padding_stays_zero_after_optimizer_steps():
  _, _, _, programs = run_job(tp=8, dp=1, failed="3", steps=3)
  assert_padding_zero(replica_view(programs[0].params))
  _, _, _, programs = run_job(tp=4, dp=2, failed="1:2", steps=3)
  for program in programs:
    for r in range(program.replicas):
      assert_padding_zero(replica_view(program.params, r))


@pytest.mark.parametrize("group", [(8, (3,)), (3, ())], ids=["tp8-failed3", "tp3-failednone"])
def test_tied_embeddings_loss_and_gradient_match_dense_reference(group):
  import dataclasses
  tp, failed = group
  cfg = dataclasses.replace(CFG, tie_embeddings=True)
  layouts = model_layouts(cfg, tp, failed)  # vocabulary 37 on 3 or 7 slots: padded rows
  assert layouts.vocab.block * layouts.vocab.degree > cfg.vocab_size
  mesh = class_mesh([0], [layouts.heads.live_slots], tp)
  graphdef, params = init_stacked_params(lambda: GPT(cfg, layouts, rngs=nnx.Rngs(4)), mesh, 1)
  assert "head" not in params
  batch = _batch(cfg, 3, 6, seed=1)
  step = make_loss_and_grad(graphdef, params, mesh, batch[:, 1:].size)
  loss, grads = jax.jit(step)(params, batch)
  params, grads = replica_view(params), replica_view(grads)

  logical = to_logical(params)
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(logical)) == count_params(cfg)
  ref_loss, ref_grads = ref.gpt_loss_and_grad(logical, batch[:, :-1], batch[:, 1:], cfg)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  # The table's gradient holds both uses (lookup and head); padded rows get none.
  assert_padding_zero(grads)
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6),
               to_logical(grads), ref_grads)


def test_same_seed_gives_same_logical_parameters_for_every_layout():
  a = to_logical(nnx.state(GPT(CFG, model_layouts(CFG, 1), rngs=nnx.Rngs(3))))
  b = to_logical(nnx.state(GPT(CFG, model_layouts(CFG, 8, (2, 5)), rngs=nnx.Rngs(3))))
  jax.tree.map(np.testing.assert_array_equal, a, b)
