"""Gradient accumulation: a share run as micro-batches equals the single pass (whole steps of
micro-batched replicas: ``tests/plans/test_accumulate_plans.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ntp_jax.parallel.accumulate import accumulate, micro_batches
from ntp_jax.parallel.plan import constant_shares


def test_micro_batches_are_near_equal_and_cover_the_rows():
  assert micro_batches(9, 2) == [(1, 5), (1, 4)]
  assert micro_batches(8, 4) == [(4, 2)]
  assert micro_batches(7, 3) == [(1, 3), (2, 2)]
  for rows in range(1, 12):
    for count in range(1, rows + 1):
      groups = micro_batches(rows, count)
      assert sum(n * size for n, size in groups) == rows
      assert sum(n for n, _ in groups) == count
      assert max(size for _, size in groups) - min(size for _, size in groups) <= 1
  with pytest.raises(ValueError, match="cannot cut 2 row"):
    micro_batches(2, 3)


@pytest.mark.parametrize("scan", [True, False])
def test_accumulated_sum_equals_one_pass(scan):
  w = jnp.arange(6.0).reshape(2, 3) / 10
  batch = jnp.arange(7 * 2, dtype=jnp.float32).reshape(7, 2)  # rows encode their index
  value_and_grad = jax.value_and_grad(lambda w, rows: jnp.sum(jnp.tanh(rows @ w) ** 2))
  want = value_and_grad(w, batch)
  got = accumulate(value_and_grad, w, batch, 3, scan=scan)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-6)


def test_constant_shares_keep_the_batch_and_follow_the_degree():
  assert constant_shares(16, {0: 4, 1: 3}) == {0: 9, 1: 7}
  assert constant_shares(12, {0: 4, 2: 4}) == {0: 6, 2: 6}
  assert constant_shares(16, {0: 8, 1: 8}) == {0: 8, 1: 8}
  assert constant_shares(2, {0: 8, 1: 1}) == {0: 1, 1: 1}  # every replica keeps a sequence
  for degrees in ({0: 4, 1: 3, 2: 2}, {0: 1, 1: 7}, {3: 5}):
    assert sum(constant_shares(13, degrees).values()) == 13
