"""Logical state through checkpoints onto any plan: values identical in logical form.

Every logical leaf (parameters and both Adam moments) holds values that encode
their own position, so a piece placed on the wrong slot, replica or offset
shows. Each plan of the list writes a checkpoint from its own layout, and each
checkpoint read on one device holds exactly the original arrays: the files are
logical, the same whichever plan wrote them. Every plan restores the checkpoint
another plan wrote, and every replica of every class reads back exactly the
original arrays.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import SMALL

from models.gpt import GPT, model_layouts
from ntp_jax.parallel.plan import make_plan
from ntp_jax.parallel.programs import abstract_class_state, build_class_programs
from ntp_jax.state.checkpoint import CheckpointError, Checkpoints
from ntp_jax.state.placement import Leaf, even_pieces, leaves_of, read_logical
from ntp_jax.state.sources import ArraySource
from ntp_jax.training.config import parse_failed, parse_weights

# (mesh.tp, mesh.dp, ntp.failed, ntp.slot_weights): failed slots at the ends and in the
# middle, 0 to 3 failures, several replicas, speed weights; 8 KV heads on 3 and 7 slots
# share their leftover groups.
PLANS = [
    (8, 1, "", ""),
    (7, 1, "0,6", ""),
    (4, 2, "1:1", ""),
    (3, 2, "0:2", ""),
    (2, 3, "1:0", ""),
    (1, 1, "", ""),
    (4, 2, "0:0,0:1,0:3", "1,2,1,0.5"),
]
OPTIMIZER = optax.adamw(1e-2)


def make(tp, dp, failed, weights, source=None):
  plan = make_plan(functools.partial(model_layouts, SMALL), tp=tp, dp=dp,
                   failed=parse_failed(failed, dp, tp), slot_weights=parse_weights(weights, tp),
                   batch_size=6, rebalance="equal")
  return build_class_programs(plan, lambda layouts: GPT(SMALL, layouts, rngs=nnx.Rngs(0)),
                              OPTIMIZER, 1.0, 36, jax.devices()[:tp * dp], source=source)


@functools.lru_cache(maxsize=1)
def encoded_state():
  """``path -> float32 array`` whose every element is distinct (leaf id, position)."""
  layouts = model_layouts(SMALL, 1)
  _, target = abstract_class_state(lambda: GPT(SMALL, layouts, rngs=nnx.Rngs(0)), 1, OPTIMIZER)
  leaves, _, _ = leaves_of(target)
  out = {}
  for i, leaf in enumerate(leaves):
    size = int(np.prod(leaf.shape))
    values = (i * 10_000 + np.arange(size)).reshape(leaf.shape)
    out[leaf.path] = values.astype(np.int32 if leaf.dtype == np.int32 else np.float32)
  return out


def assert_holds(programs, expected):
  for program in programs:
    for replica in range(program.replicas):
      got = read_logical({"params": program.params, "opt_state": program.opt_state},
                         program.mesh, replica)
      assert set(got) == set(expected)
      for path, value in expected.items():
        np.testing.assert_array_equal(np.asarray(got[path]), value,
                                      err_msg=f"{'/'.join(path)} class "
                                      f"{program.replica_class.index} replica {replica}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """One checkpoint per plan, written from that plan's layout."""
  expected = encoded_state()
  written = []
  for i, plan in enumerate(PLANS):
    programs = make(*plan, source=ArraySource(expected))
    assert_holds(programs, expected)
    store = Checkpoints(str(tmp_path_factory.mktemp(f"ckpt{i}")))
    store.save(7, read_logical({"params": programs[0].params,
                                "opt_state": programs[0].opt_state}, programs[0].mesh),
               {"data_cursor": 0})
    store.close()
    written.append(store)
  return written


def test_every_plan_writes_the_same_logical_checkpoint(checkpoints):
  expected = encoded_state()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  requests = {path: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=device)
              for path, value in expected.items()}
  for store, plan in zip(checkpoints, PLANS):
    got = store.restore(7, requests)
    assert set(got) == set(expected)
    for path, value in expected.items():
      np.testing.assert_array_equal(np.asarray(got[path]), value,
                                    err_msg=f"{'/'.join(path)} written by {plan}")


@pytest.mark.parametrize("target", PLANS, ids=lambda p: f"tp{p[0]}-dp{p[1]}-f{p[2]}-w{p[3]}")
def test_every_plan_restores_another_plans_checkpoint_exactly(target, checkpoints):
  writer = (PLANS.index(target) + 1) % len(PLANS)  # each checkpoint restored once, elsewhere
  assert_holds(make(*target, source=checkpoints[writer].source(7)), encoded_state())


def test_restore_into_another_model_names_the_parameter_and_both_shapes(checkpoints):
  import dataclasses
  bigger_vocab = dataclasses.replace(SMALL, vocab_size=41)
  plan = make_plan(functools.partial(model_layouts, bigger_vocab), tp=4, dp=1,
                   batch_size=6, rebalance="equal")
  with pytest.raises(CheckpointError, match=r"params/embed/embedding has shape \(37, 16\), "
                     r"the model expects \(41, 16\)"):
    build_class_programs(plan, lambda layouts: GPT(bigger_vocab, layouts, rngs=nnx.Rngs(0)),
                         OPTIMIZER, 1.0, 36, jax.devices()[:4], source=checkpoints[0].source(7))
  deeper = dataclasses.replace(SMALL, n_layers=3)
  plan = make_plan(functools.partial(model_layouts, deeper), tp=4, dp=1, batch_size=6)
  # Stacked blocks: a deeper model differs in the layer axis of the first block parameter.
  with pytest.raises(CheckpointError, match=r"params/blocks/\S+ has shape \(2, .*\), "
                                            r"the model expects \(3, "):
    build_class_programs(plan, lambda layouts: GPT(deeper, layouts, rngs=nnx.Rngs(0)), OPTIMIZER,
                         1.0, 36, jax.devices()[:4], source=checkpoints[0].source(7))


def test_even_pieces_divide_and_fit_the_degree():
  assert even_pieces(37, 7) == 1 and even_pieces(20, 7) == 5 and even_pieces(2048, 7) == 4
  assert even_pieces(128256, 7) == 6 and even_pieces(16, 8) == 8 and even_pieces(5, 1) == 1
  layout = model_layouts(SMALL, 8, (3,)).vocab
  leaf = Leaf(("x",), (37, 16), np.dtype(np.float32), layout, 0)
  assert leaf.even_layout.sizes == (37, 0, 0, 0, 0, 0, 0)
