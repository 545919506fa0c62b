"""Whole steps of micro-batched replicas (``parallel.accumulate``) equal the single pass."""

import numpy as np
import pytest
from helpers import assert_trees_close, run_job


@pytest.mark.parametrize("tp,dp,failed", [(4, 1, "2"), (4, 2, "1:2")])
def test_micro_batched_steps_equal_single_pass_steps(tp, dp, failed):
  """4 micro-batches per healthy replica (the reduced one runs fewer) against one pass: the
  same losses and parameters after three steps."""
  one, plan, params, _ = run_job(tp=tp, dp=dp, failed=failed, batch_size=8 * dp,
                                 rebalance="proportional")
  four, plan4, params4, _ = run_job(tp=tp, dp=dp, failed=failed, batch_size=8 * dp,
                                    rebalance="proportional", microbatches=4)
  assert [c.microbatches for c in plan4.classes] == [
      -(-c.batch_share // 2) for c in plan.classes]
  np.testing.assert_allclose(four, one, rtol=1e-6, atol=1e-6)
  assert_trees_close(params4, params)
