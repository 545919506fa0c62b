"""The live move in one process (``state.peer_move``): only the units whose device changes move,
and the new blocks equal a placement of the same logical state, padding included.

The plan is checked without devices first (each new block rebuilt in numpy from the old
blocks of logical indices), then on devices: a healthy job's state, every element distinct,
moved live onto the plan after a failure, a repair and a second failure.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL

from models.gpt import GPT, model_layouts
from ntp_jax.parallel.plan import make_plan
from ntp_jax.parallel.programs import ProgramCache, build_class_programs
from ntp_jax.sharding.layout import make_layout
from ntp_jax.state.peer import PeerSource, poison
from ntp_jax.state.peer_move import held_runs, plan_blocks, rounds_of
from ntp_jax.state.placement import Leaf, leaves_of
from ntp_jax.state.sources import ArraySource
from ntp_jax.training.config import parse_failed

F32 = np.dtype(np.float32)


def grid(replicas, degree, tag):
  return np.array([[f"{tag}r{r}s{s}" for s in range(degree)] for r in range(replicas)],
                  dtype=object)


def kernel(layout, path=("params", "w")):
  return Leaf(path, (layout.size, 3), F32, layout, 0)


def old_blocks(layout, devices):
  """Per device, the logical indices its block holds (-1: padding)."""
  return {d: layout.gather_index()[j] for row in devices for j, d in enumerate(row)}


@pytest.mark.parametrize("units,shared", [(10, False), (8, True)])
def test_each_new_block_is_its_layout_and_only_moved_units_are_counted(units, shared):
  """4 slots x 2 replicas, slot 3 of replica 0 dead: replica 0 goes to degree 3 (10 units
  do not divide; 8 KV groups share their leftover), replica 1 stays as it was."""
  old_layout = make_layout(units, 4, share_remainder=shared)
  new_layout = make_layout(units, 4, failed=(3,), share_remainder=shared)
  old_grid, new_grid = grid(2, 4, "old"), grid(2, 4, "old")[:1, :3]
  dead = {old_grid[0, 3]}
  plans = plan_blocks([(old_grid, {("params", "w"): kernel(old_layout)})], dead,
                      [([kernel(new_layout)], new_grid)])
  held = old_blocks(old_layout, old_grid)
  moved = 0
  for plan in plans:
    j = list(new_grid[0]).index(plan.device)
    rebuilt = np.full(new_layout.block, -1)
    for part in plan.parts:
      assert part.device not in dead
      if part.device is not None:
        rebuilt[part.at:part.at + part.length] = held[part.device][
            part.start:part.start + part.length]
        moved += part.length * (part.device != plan.device)
    np.testing.assert_array_equal(rebuilt, new_layout.gather_index()[j])
    # The minimum: what the device holds now and did not hold before.
    want = set(new_layout.gather_index()[j]) - set(held[plan.device]) - {-1}
    assert sum(p.length for p in plan.parts if p.device not in (None, plan.device)) == len(want)
  assert moved > 0


def test_a_block_that_does_not_change_is_kept_and_a_lost_unit_is_named():
  layout = make_layout(8, 2)
  old_grid = grid(2, 2, "")
  plans = plan_blocks([(old_grid, {("params", "w"): kernel(layout)})], {old_grid[0, 0]},
                      [([kernel(layout)], old_grid[1:])])
  assert all(p.kept is not None and p.parts == () for p in plans)
  assert held_runs(layout, 1) == ((4, 8, 0),)
  with pytest.raises(LookupError, match=r"params/w: no live device holds elements 0\.\.3"):
    plan_blocks([(old_grid, {("params", "w"): kernel(layout)})],
                {old_grid[0, 0], old_grid[1, 0]}, [([kernel(layout)], old_grid[1:])])


def test_near_holders_go_first_then_the_sends_are_spread():
  """Two processes (the tag's first letter), replica 1 of process b lost slot 1: its new
  blocks take what replica 1 lacks from process b's other replica, not from process a."""
  layout, reduced = make_layout(8, 2), make_layout(8, 2, failed=(1,))
  grid_a, grid_b = grid(1, 2, "a"), grid(2, 2, "b")
  old = [(grid_a, {("params", "w"): kernel(layout)}), (grid_b, {("params", "w"): kernel(layout)})]
  plans = plan_blocks(old, {grid_b[1, 1]}, [([kernel(reduced)], grid_b[1:, :1])],
                      near=lambda holder, device: holder[0] == device[0])
  [plan] = plans
  assert {p.device for p in plan.parts} == {grid_b[1, 0], grid_b[0, 1]}
  # Without the preference the least-loaded holder is the first in plan order.
  [plan] = plan_blocks(old, {grid_b[1, 1]}, [([kernel(reduced)], grid_b[1:, :1])])
  assert grid_a[0, 1] in {p.device for p in plan.parts}


def test_rounds_send_and_receive_at_most_once_per_device_and_keep_every_pair():
  pairs = [(0, 4), (0, 5), (1, 5), (2, 6), (0, 6), (3, 4)]
  rounds = rounds_of(pairs)
  assert sorted(p for r in rounds for p in r) == sorted(pairs)
  for r in rounds:
    assert len({s for s, _ in r}) == len(r) and len({t for _, t in r}) == len(r)
  assert len(rounds) == 3  # device 0 sends three pieces: no fewer rounds can carry them


def make(tp, dp, failed, source, cache):
  plan = make_plan(functools.partial(model_layouts, SMALL), tp=tp, dp=dp,
                   failed=parse_failed(failed, dp, tp), batch_size=6, rebalance="equal")
  import optax
  return build_class_programs(plan, lambda layouts: GPT(SMALL, layouts, rngs=nnx.Rngs(0)),
                              optax.adamw(1e-2), 1.0, 36, jax.devices()[:tp * dp], source=source,
                              cache=cache)


def encoded(programs):
  """``path -> array``: every element distinct (leaf id, position), the model's shapes."""
  leaves, _, _ = leaves_of({"params": programs[0].params, "opt_state": programs[0].opt_state})
  return {leaf.path: (i * 10_000 + np.arange(int(np.prod(leaf.shape)))).reshape(
      leaf.shape).astype(leaf.dtype) for i, leaf in enumerate(leaves)}


def blocks(programs):
  return [jax.tree.map(np.asarray, (p.params, p.opt_state)) for p in programs]


@pytest.mark.parametrize("before,after", [("", "0:3"), ("0:3", ""), ("1:1", "1:1,0:0")],
                         ids=["failure", "repair", "second-failure"])
def test_the_live_move_equals_placing_the_logical_state(before, after):
  """4 slots x 2 replicas of the small model; the old state encodes every element, the dead
  devices are poisoned, and the moved blocks equal the blocks placed from the logical state."""
  cache = ProgramCache()
  old = make(4, 2, before, None, cache)
  logical = encoded(old)
  old = make(4, 2, before, ArraySource(logical), cache)
  lost = set(parse_failed(after, 2, 4)) - set(parse_failed(before, 2, 4))
  dead = {jax.devices()[r * 4 + s] for r, s in lost}
  poison(old, dead)
  source = PeerSource(old, dead, cache=cache)
  moved = make(4, 2, after, source, cache)
  expected = make(4, 2, after, ArraySource(logical), cache)
  for got, want in zip(blocks(moved), blocks(expected)):
    jax.tree.map(np.testing.assert_array_equal, got, want)
  assert source.copied_bytes > 0 and source.transfer_s > 0
