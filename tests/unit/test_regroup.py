"""Sync positions of a flattened gradient: near-equal runs or the nested core/extra regroup."""

from ntp_jax.parallel.regroup import choose_regroup, equal_regroup, nested_regroup
from ntp_jax.sharding.layout import Layout, make_layout


def _flat(num_units, tp, failed=(), unit_size=5):
  return make_layout(num_units, tp, failed=failed, unit_size=unit_size)


def test_nested_regroup_moves_only_the_extra_slots_of_its_reference():
  healthy = _flat(56, 8)
  nested = nested_regroup(healthy, 7)
  equal = equal_regroup(healthy.size, 7)
  assert nested.block == equal.block  # buffers as long as near-equal runs': same all-reduce
  assert [c + e for c, e in zip(nested.core, nested.extra)] == list(equal.core)
  assert nested.moved(healthy) == healthy.sizes[7]  # slot 7's elements, nothing else
  assert equal.moved(healthy) > 3 * healthy.sizes[7]


def test_choice_follows_the_replica_counts():
  healthy, reduced = _flat(56, 8), _flat(56, 8, failed=(3,))
  one_each = choose_regroup([(healthy, 1), (reduced, 1)], 7)
  many_healthy = choose_regroup([(healthy, 7), (reduced, 1)], 7)
  assert one_each.split == one_each.size  # near-equal runs: the reduced replica moves nothing
  assert many_healthy.split < many_healthy.size  # nested: each healthy replica moves 1/8
  for regroup in (one_each, many_healthy):
    cost = regroup.moved(healthy) * (7 if regroup is many_healthy else 1) + regroup.moved(reduced)
    for other in (equal_regroup(healthy.size, 7), nested_regroup(healthy, 7)):
      assert cost <= other.moved(healthy) * (7 if regroup is many_healthy else 1) + other.moved(
          reduced)


def test_no_nested_regroup_when_a_core_run_is_longer_than_its_position():
  # Targets for 6 elements on 3 positions: 2 each; a slot weighted to hold 3 cannot stay.
  assert nested_regroup(Layout(tp=4, live_slots=(0, 1, 2, 3), units=(1, 1, 3, 1)), 3) is None
  assert nested_regroup(Layout(tp=4, live_slots=(0, 1, 2, 3), units=(2, 1, 2, 1)), 3) is not None
