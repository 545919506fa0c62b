"""Live recovery's choice of supplying replicas, without moving any data."""

import numpy as np

from ntp_jax.sharding.layout import Layout
from ntp_jax.state.peer_supply import Holder, Supply, SupplyChoice
from ntp_jax.state.placement import Leaf

KERNEL = ("params", "mlp", "kernel")
SCALE = ("params", "norm", "scale")


def grid(replicas, degree, tag=""):
  return np.array([[f"{tag}r{r}s{s}" for s in range(degree)] for r in range(replicas)],
                  dtype=object)


def holder(replicas, degree, units, tag=""):
  layout = Layout(tp=degree, live_slots=tuple(range(degree)), units=units)
  leaves = {KERNEL: Leaf(KERNEL, (layout.size, 3), np.dtype("float32"), layout, 0),
            SCALE: Leaf(SCALE, (3,), np.dtype("float32"))}
  return Holder(grid(replicas, degree, tag), leaves)


def test_each_piece_comes_from_a_replica_whose_devices_holding_it_are_alive():
  choice = SupplyChoice([holder(2, 4, (2, 2, 2, 2))], dead={"r0s1"})
  supply = choice.choose(KERNEL, 4)
  assert supply == Supply(0, ((0, 1), (1,), (0, 1), (0, 1)))
  # A target device that holds a live copy keeps it; otherwise the first live copy moves.
  assert choice.piece_source(supply, 0, "r0s0") == ("r0s0", 0)
  assert choice.piece_source(supply, 1, "r0s2") == ("r1s1", 1)
  assert choice.piece_source(supply, 2, "new") == ("r0s2", 0)


def test_two_pieces_each_made_of_two_slots():
  choice = SupplyChoice([holder(2, 4, (2, 2, 2, 2))], dead={"r0s1"})
  target = Leaf(KERNEL, (8, 3), np.dtype("float32"),
                Layout(tp=4, live_slots=(0, 2, 3), units=(3, 3, 2)), 0)
  assert choice.pieces(target, min_degree=3) == 2
  assert choice.choose(KERNEL, 2) == Supply(0, ((1,), (0, 1)))


def test_no_live_copy_of_a_piece_means_no_supply():
  choice = SupplyChoice([holder(2, 4, (2, 2, 2, 2))], dead={"r0s1", "r1s1"})
  assert choice.choose(KERNEL, 4) is None
  assert choice.choose(KERNEL, 2) is None
  assert choice.choose(KERNEL, 1) is None  # the one piece needs every slot


def test_a_later_class_supplies_what_the_first_cannot():
  first = holder(1, 2, (4, 4), tag="a")
  second = holder(1, 4, (2, 2, 2, 2), tag="b")
  choice = SupplyChoice([first, second], dead={"ar0s0"})
  assert choice.choose(KERNEL, 2) == Supply(1, ((0,), (0,)))
  assert choice.choose(KERNEL, 4) == Supply(1, ((0,), (0,), (0,), (0,)))  # 4 > degree 2


def test_an_unsplit_leaf_comes_from_any_live_device_of_a_live_replica():
  choice = SupplyChoice([holder(2, 2, (4, 4))], dead={"r0s0", "r0s1", "r1s0"})
  supply = choice.choose(SCALE, 1)
  assert supply == Supply(0, ((1,),))
  assert choice.whole_source(supply, "r1s1") == ("r1s1", 1)
  assert choice.whole_source(supply, "new") == ("r1s1", 1)
