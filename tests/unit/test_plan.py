"""Plans: failed-slot parsing, classes, dropped replicas, batch shares, and their errors."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL

import configs.gpt_tiny
from models.gpt import model_layouts
from ntp_jax.errors import ConfigError
from ntp_jax.layers import TPParam
from ntp_jax.layers.shard import stack_replicas
from ntp_jax.parallel.grad_norm import clip_by_logical_norm, logical_norm
from ntp_jax.parallel.plan import make_plan
from ntp_jax.sharding.blocks import to_blocks
from ntp_jax.sharding.layout import make_layout
from ntp_jax.training.config import RunConfig, parse_failed, parse_weights

_make_plan = functools.partial(make_plan, functools.partial(model_layouts, SMALL))


def plan_of(*, tp, dp, failed="", slot_weights="", **kwargs):
  """``make_plan`` with ``ntp.failed`` / ``ntp.slot_weights`` text, parsed as the config does."""
  return _make_plan(tp=tp, dp=dp, failed=parse_failed(failed, dp, tp),
                    slot_weights=parse_weights(slot_weights, tp), **kwargs)


def test_parse_failed_forms():
  assert parse_failed("", 2, 8) == set()
  assert parse_failed("3", 2, 8) == {(0, 3)}
  assert parse_failed("3,5", 2, 8) == {(0, 3), (0, 5)}
  assert parse_failed("1:3", 2, 8) == {(1, 3)}
  assert parse_failed("0:2, 1:5,1:6", 2, 8) == {(0, 2), (1, 5), (1, 6)}
  assert parse_failed("4,1:4", 2, 8) == {(0, 4), (1, 4)}


@pytest.mark.parametrize("text,match", [
    ("2:1", "ntp.failed: replica 2 in '2:1' does not exist"),
    ("1:8", "ntp.failed: slot 8 in '1:8' does not exist"),
    ("1:3,1:3", "ntp.failed: replica 1 slot 3 is listed twice"),
    ("3,0:3", "ntp.failed: replica 0 slot 3 is listed twice"),
    ("a", "ntp.failed: 'a' is not a slot"),
    ("1:", "ntp.failed: '1:' is not a slot"),
    ("-1", "ntp.failed: '-1' is not a slot"),
])
def test_parse_failed_errors_name_the_field(text, match):
  with pytest.raises(ConfigError, match=match):
    parse_failed(text, 2, 8)


def test_a_malformed_failed_slot_is_said_once():
  with pytest.raises(ConfigError) as err:
    parse_failed("-1", 2, 8)
  assert str(err.value) == "ntp.failed: '-1' is not a slot ('3') or a replica:slot pair ('1:3')"
  with pytest.raises(ConfigError) as err:
    parse_failed("3, x", 2, 8)
  assert str(err.value) == ("ntp.failed: 'x' (in '3, x') is not a slot ('3') or a replica:slot "
                            "pair ('1:3')")


def test_classes_shares_and_dropped_replicas():
  plan = plan_of(tp=4, dp=4, failed="1:2,2:2,3:0,3:1,3:2,3:3", batch_size=16)
  assert plan.dropped == (3,)
  assert [(c.replicas, c.degree) for c in plan.classes] == [((0,), 4), ((1, 2), 3)]
  assert [r.batch_share for r in plan.replicas] == [4, 3, 3]
  assert plan.global_batch == 10 and plan.live_devices == 10
  assert plan.class_rows() == [(0, 4), (4, 10)]
  text = plan.describe()
  assert "replica 3: dropped (every slot failed)" in text
  assert "replica 1: TP degree 3 (reduced), live slots 0,1,3, class 1, batch share 3" in text


def test_replicas_that_lost_different_slots_share_one_class():
  plan = plan_of(tp=4, dp=3, failed="1:2,2:0", batch_size=12)
  assert [(c.replicas, c.live_slots) for c in plan.classes] == [
      ((0,), ((0, 1, 2, 3),)), ((1, 2), ((0, 1, 3), (1, 2, 3)))]
  # Speed weights make the unit split depend on which slots are live: separate classes.
  weighted = plan_of(tp=4, dp=3, failed="1:2,2:0", slot_weights="1,1,0.2,1", batch_size=12)
  assert len(weighted.classes) == 3


def test_equal_rebalance_and_proportional_rounding():
  assert [r.batch_share for r in plan_of(tp=8, dp=2, failed="1:3", batch_size=32,
                                         rebalance="equal").replicas] == [16, 16]
  # 7/8 of 16 = 14; 5/8 of 16 = 10
  assert [r.batch_share for r in plan_of(tp=8, dp=3, failed="1:3,2:0,2:1,2:2",
                                         batch_size=48).replicas] == [16, 14, 10]
  # 2x4 with one slot failed keeps 7/8 of the healthy tokens; dropping keeps 1/2.
  ntp = plan_of(tp=4, dp=2, failed="1:2", batch_size=8)
  drop = plan_of(tp=4, dp=2, failed="1:0,1:1,1:2,1:3", batch_size=8)
  assert ntp.global_batch / 8 == 7 / 8 and drop.global_batch / 8 == 1 / 2


@pytest.mark.parametrize("kwargs,match", [
    (dict(failed="0:0,0:1,0:2,0:3"), "ntp.failed: every slot of every replica failed"),
    (dict(slot_weights="1,2"), "ntp.slot_weights: 2 weights given, mesh.tp=4"),
    (dict(slot_weights="1,x,1,1"), "ntp.slot_weights: '1,x,1,1' is not"),
    (dict(slot_weights="1,-1,1,1"), "ntp.slot_weights: weights must be >= 0"),
    (dict(slot_weights="1,nan,1,1"), "ntp.slot_weights: weights must be finite"),
    (dict(slot_weights="0,0,0,0"), "ntp.slot_weights: at least one weight must be positive"),
    (dict(slot_weights="1,0,0,0", failed="0"),
     "ntp.slot_weights: replica 0's live slots 1,2,3 all have weight 0"),
    (dict(tp=0), "mesh.tp: must be >= 1"),
    (dict(rebalance="fair"), "ntp.rebalance: 'fair' is not one of"),
    (dict(batch_size=3, dp=2), "train.batch_size: 3 sequences do not split evenly"),
])
def test_bad_plans_raise_one_line_errors(kwargs, match):
  """Settings are checked by the config (``RunConfig``), the failure state by the plan."""
  args = dict(tp=4, dp=1, batch_size=4)
  args.update(kwargs)
  config = configs.gpt_tiny.get_config()
  config.mesh.tp, config.mesh.dp, config.train.batch_size = args["tp"], args["dp"], args[
      "batch_size"]
  config.ntp.failed = args.get("failed", "")
  config.ntp.slot_weights = args.get("slot_weights", "")
  config.ntp.rebalance = args.get("rebalance", "proportional")
  with pytest.raises(ConfigError, match=match) as info:
    run = RunConfig.from_config(config)
    _make_plan(tp=run.mesh.tp, dp=run.mesh.dp, failed=run.ntp.failed,
               slot_weights=run.ntp.slot_weights, batch_size=run.train.batch_size,
               rebalance=run.ntp.rebalance)
  assert "\n" not in str(info.value)


def test_logical_norm_counts_each_element_once():
  """Replicated scales plus uneven split kernels, stacked over 3 replicas."""
  rng = np.random.default_rng(0)
  scale = rng.normal(size=5)
  kernel = rng.normal(size=(4, 7))
  layout = make_layout(7, 4, failed=[1])  # 3,2,2 columns over 3 live slots
  grads = nnx.State({
      "norm": nnx.Param(jnp.asarray(scale, jnp.float32)),
      "kernel": TPParam(to_blocks(jnp.asarray(kernel, jnp.float32), layout, 1),
                        tp_layout=layout, tp_axis=1),
  })
  true_norm = np.sqrt(np.sum(scale ** 2) + np.sum(kernel ** 2))
  np.testing.assert_allclose(logical_norm(grads), true_norm, rtol=1e-6)
  np.testing.assert_allclose(logical_norm(stack_replicas(grads, 3), 3, stacked=True), true_norm,
                             rtol=1e-6)
  # True norm 0.8 with clip 1.0: nothing is scaled; clip 0.4 halves every entry.
  small = jax_scale(grads, 0.8 / true_norm)
  norm = logical_norm(small)
  np.testing.assert_allclose(norm, 0.8, rtol=1e-6)
  same = clip_by_logical_norm(small, norm, 1.0)
  np.testing.assert_array_equal(same["kernel"][...], small["kernel"][...])
  halved = clip_by_logical_norm(small, norm, 0.4)
  np.testing.assert_allclose(halved["norm"][...], small["norm"][...] / 2, rtol=1e-6)
  # Each replica's own norm (steps that commit: no sum across replicas), and each replica
  # clipped by its own: the same as the whole stack clipped by the one norm.
  stacked = stack_replicas(small, 3)
  rows = logical_norm(stacked, stacked=True, per_replica=True)
  np.testing.assert_allclose(rows, [0.8] * 3, rtol=1e-6)
  by_rows = clip_by_logical_norm(stacked, rows, 0.4)
  whole = clip_by_logical_norm(stacked, logical_norm(stacked, 3, stacked=True), 0.4)
  for name in ("norm", "kernel"):
    np.testing.assert_allclose(by_rows[name][...], whole[name][...], rtol=1e-6)


def test_logical_norm_counts_shared_units_once():
  rng = np.random.default_rng(1)
  kernel = rng.normal(size=(3, 8))
  layout = make_layout(8, 3, share_remainder=True)  # 2,2,2 + 2 shared
  grads = nnx.State({"k": TPParam(to_blocks(jnp.asarray(kernel, jnp.float32), layout, 1),
                                  tp_layout=layout, tp_axis=1)})
  np.testing.assert_allclose(logical_norm(grads), np.linalg.norm(kernel), rtol=1e-6)
  np.testing.assert_allclose(logical_norm(stack_replicas(grads, 2), 2, stacked=True),
                             np.linalg.norm(kernel), rtol=1e-6)


def jax_scale(state, factor):
  import jax
  return jax.tree.map(lambda x: x * factor, state)


def test_peer_groups_pair_the_core_slots_of_every_replica():
  plan = plan_of(tp=4, dp=3, failed="1:0,2:1,2:2", batch_size=12)
  assert plan.t_min == 2
  assert plan.peer_groups() == [[(0, 0), (1, 1), (2, 0)], [(0, 1), (1, 2), (2, 3)]]
  assert "group 1: replica 0 slot 1, replica 1 slot 2, replica 2 slot 3" in plan.describe()
