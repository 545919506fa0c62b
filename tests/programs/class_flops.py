"""Executed flops per device (XLA cost analysis) of the plans tests/integration/test_cost.py
checks, under the production codegen flags (tests/codegen.py says why). Prints one JSON line.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/programs/class_flops.py
"""

import dataclasses
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from helpers import SMALL  # noqa: E402

from models.gpt import GPT, model_layouts  # noqa: E402
from ntp_jax.analysis.cost import class_step_flops, own_shard_flops  # noqa: E402
from ntp_jax.parallel.plan import make_plan  # noqa: E402
from ntp_jax.parallel.programs import PlanPrograms  # noqa: E402
from ntp_jax.parallel.step_modes import make_job_step  # noqa: E402
from ntp_jax.training.config import parse_failed  # noqa: E402

SEQ = 128  # enough tokens that per-step work dominates the per-parameter sync work
UNROLLED = dataclasses.replace(SMALL, scan_layers=False)  # cost analysis counts a loop body once


def job(cfg, tp, dp, failed, batch_size):
  plan = make_plan(functools.partial(model_layouts, cfg), tp=tp, dp=dp,
                   failed=parse_failed(failed, dp, tp), batch_size=batch_size)
  programs = PlanPrograms(plan, lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(0)),
                          optax.adamw(1e-3), 1.0, plan.global_batch * SEQ,
                          jax.devices()[:tp * dp]).abstract()  # shapes: nothing placed
  return make_job_step(plan, programs)


def flops_by_class(failed):
  step = job(UNROLLED, 4, 2, failed, 8)
  return {p.replica_class.degree: class_step_flops(step, p, SEQ) for p in step.programs}


def reduced_replica():
  """8 KV groups at degree 3 (2 each + 2 shared by position); every other split even
  (d_ff 24 = 3 x 8, vocabulary 48): the degree-3 class's flops and each position's need."""
  cfg = dataclasses.replace(UNROLLED, d_ff=24, ffn_granularity=1, vocab_size=48)
  step = job(cfg, 4, 2, "1:2", 8)
  reduced = [p for p in step.programs if p.replica_class.degree == 3][0]
  cache = {}
  need = [own_shard_flops(cfg, reduced.replica_class, position, SEQ, cache,
                          lambda model, degree, share: job(model, degree, 1, "", share))
          for position in range(3)]
  return class_step_flops(step, reduced, SEQ), need


if __name__ == "__main__":
  executed, need = reduced_replica()
  print(json.dumps({"by_failed": {failed: flops_by_class(failed)
                                  for failed in ("", "1:2", "1:1,1:2")},
                    "reduced": {"executed": executed, "need": need}}))
