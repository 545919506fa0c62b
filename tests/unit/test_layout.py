"""Layouts: apportionment, failed slots, weights, and their errors."""

import numpy as np
import pytest

from ntp_jax.errors import ConfigError
from ntp_jax.sharding.layout import Layout, apportion, live_slots, make_layout, units_of


def test_equal_split_of_divisible_dim():
  layout = make_layout(8, 8)
  assert layout.units == (1,) * 8
  assert layout.block == 1 and layout.offsets == tuple(range(8))


def test_eight_kv_heads_on_seven_slots_after_failure():
  layout = make_layout(8, 8, failed=[3])
  assert layout.live_slots == (0, 1, 2, 4, 5, 6, 7)
  assert layout.units == (2, 1, 1, 1, 1, 1, 1)
  assert layout.block_units == 2


def test_issue_cases():
  assert make_layout(5, 2).units == (3, 2)  # d_ff 5 on 2 slots
  heads = make_layout(8, 3)  # 8 KV heads, 16 query heads on 3 slots
  assert heads.units == (3, 3, 2)
  assert heads.with_unit_size(2).sizes == (6, 6, 4)
  vocab = make_layout(50257, 7)
  assert sum(vocab.units) == 50257 and max(vocab.units) - min(vocab.units) <= 1
  assert make_layout(7, 8).units == (1, 1, 1, 1, 1, 1, 1, 0)


def test_unit_size_scales_sizes_and_offsets():
  layout = make_layout(5, 2, unit_size=4)
  assert layout.sizes == (12, 8) and layout.offsets == (0, 12) and layout.size == 20
  assert layout.block == 12


def test_weights_proportional_with_largest_remainder():
  # quotas 4, 2, 2 -> exact
  assert make_layout(8, 3, weights=[2, 1, 1]).units == (4, 2, 2)
  # quotas 3.33, 3.33, 3.33 -> one extra unit to the lowest index
  assert apportion(10, [1, 1, 1]) == (4, 3, 3)
  # a slow slot gets less; zero weight gets nothing
  assert apportion(10, [1, 1, 0]) == (5, 5, 0)
  # failed slots' weights are ignored
  assert make_layout(6, 3, failed=[0], weights=[100, 1, 2]).units == (2, 4)


@pytest.mark.parametrize("num_units,weights", [(17, [0.3, 1.7, 2.2, 0.9]), (128256, [1] * 7),
                                               (0, [1, 1]), (3, [5, 1, 1, 1, 1])])
def test_apportion_sums_and_stays_within_one_unit_of_quota(num_units, weights):
  units = np.array(apportion(num_units, weights))
  quota = num_units * np.array(weights) / np.sum(weights)
  assert units.sum() == num_units
  assert np.all(np.abs(units - quota) < 1)


def test_own_size_is_where_shared_units_start():
  layout = make_layout(5, 2, unit_size=4)  # own runs 3, 2: block 3 units, none shared
  assert layout.own_size == 12 == layout.block
  shared = make_layout(8, 3, unit_size=2, share_remainder=True)  # 2,2,2 +2 shared
  assert shared.own_size == 4 and shared.block == 8
  assert shared.gather_index()[:, shared.own_size:].tolist() == [[12, 13, 14, 15]] * 3


def test_gather_and_scatter_index_are_inverse():
  layout = make_layout(7, 4, failed=[1], unit_size=3)
  gather = layout.gather_index().reshape(-1)
  assert np.array_equal(gather[layout.scatter_index()], np.arange(layout.size))
  assert np.sum(gather >= 0) == layout.size


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_units=4, tp=2, failed=[0, 1]), r"^live_slots: failed lists all 2 slots"),
    (dict(num_units=4, tp=2, failed=[0, 1, 0]), r"^live_slots: 3 failed slots but tp is 2"),
    (dict(num_units=4, tp=2, failed=[2]), r"^live_slots: failed slot 2 is outside \[0, 2\)"),
    (dict(num_units=4, tp=3, failed=[1, 1]), r"^live_slots: repeated slot in failed"),
    (dict(num_units=4, tp=2, weights=[1, -1]), r"^apportion: weights must be >= 0"),
    (dict(num_units=4, tp=2, weights=[1, float("nan")]), r"^apportion: weights must be finite"),
    (dict(num_units=4, tp=2, weights=[1, float("inf")]), r"^apportion: weights must be finite"),
    (dict(num_units=4, tp=2, weights=[0, 0]), r"^apportion: weights need a positive entry"),
    (dict(num_units=4, tp=2, weights=[1, 1, 1]), r"^make_layout: weights has 3 entries, "
                                                 r"expected tp=2"),
    (dict(num_units=-1, tp=2), r"^apportion: num_units must be >= 0"),
    (dict(num_units=4, tp=0), r"^live_slots: tp must be >= 1"),
])
def test_invalid_requests_raise_value_error_naming_the_argument(kwargs, match):
  """Layouts know no config: the error names the argument (plan.py names the field)."""
  with pytest.raises(ValueError, match=match) as info:
    make_layout(**kwargs)
  assert not isinstance(info.value, ConfigError)


def test_granularity_must_divide():
  assert units_of(14336, 2048) == 7
  with pytest.raises(ValueError, match=r"^units_of: granularity 3 does not divide dim 10$"):
    units_of(10, 3)
  with pytest.raises(ValueError, match=r"^units_of: granularity must be >= 1, got 0$"):
    units_of(10, 0)


@pytest.mark.parametrize("fields,match", [
    (dict(n_heads=6, n_kv_heads=4), "model.n_heads: 6 is not a multiple of model.n_kv_heads 4"),
    (dict(ffn_granularity=3), "model.ffn_granularity: 3 does not divide model.d_ff 4"),
    (dict(vocab_granularity=3), "model.vocab_granularity: 3 does not divide model.vocab_size 8"),
    (dict(vocab_granularity=0), "model.vocab_granularity: must be >= 1, got 0"),
])
def test_model_config_errors_name_the_field(fields, match):
  from models.gpt import GPTConfig
  shape = dict(vocab_size=8, d_model=8, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=2, d_ff=4)
  with pytest.raises(ConfigError, match=f"^{match}$") as info:
    GPTConfig(**{**shape, **fields})
  assert "\n" not in str(info.value)


def test_layout_rejects_inconsistent_fields():
  with pytest.raises(ValueError):
    Layout(tp=2, live_slots=(0, 1), units=(1,))
  assert live_slots(4, [0, 3]) == (1, 2)
