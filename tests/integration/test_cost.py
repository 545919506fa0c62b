"""Executed flops per device (XLA cost analysis): healthy replicas pay nothing for a failure."""

import dataclasses
import functools

import jax
import optax
import pytest
from flax import nnx
from helpers import SMALL

from models.gpt import GPT, model_layouts
from ntp_jax.parallel.cost import class_step_flops
from ntp_jax.parallel.job_step import JobStep
from ntp_jax.parallel.plan import make_plan
from ntp_jax.parallel.programs import build_class_programs
from ntp_jax.train.config import parse_failed

SEQ = 128  # enough tokens that per-step work dominates the per-parameter sync work


def _job(cfg, tp, dp, failed, batch_size):
  plan = make_plan(functools.partial(model_layouts, cfg), tp=tp, dp=dp,
                   failed=parse_failed(failed, dp, tp),
                   batch_size=batch_size)
  programs = build_class_programs(plan, lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(0)),
                                  optax.adamw(1e-3), 1.0, plan.global_batch * SEQ,
                                  jax.devices()[:tp * dp])
  return JobStep(plan, programs)


UNROLLED = dataclasses.replace(SMALL, scan_layers=False)  # cost analysis counts a loop body once


def _flops_by_class(failed):
  job = _job(UNROLLED, 4, 2, failed, 8)
  return {p.replica_class.degree: class_step_flops(job, p, SEQ) for p in job.programs}


@pytest.fixture(scope="module")
def healthy():
  return _flops_by_class("")[4]


@pytest.mark.parametrize("failed,reduced_degree", [("1:2", 3), ("1:1,1:2", 2)])
def test_healthy_replica_executes_its_own_work_only(healthy, failed, reduced_degree):
  flops = _flops_by_class(failed)
  assert set(flops) == {4, reduced_degree}
  # The healthy class keeps its own block size: at most 2 % over the healthy plan
  # (the difference is the sync's reshard, which is per parameter, not per token).
  assert flops[4] <= 1.02 * healthy, (flops[4], healthy)
  assert flops[4] >= healthy



def test_every_device_of_a_reduced_replica_executes_within_2_percent_of_its_own_need():
  """8 KV groups at degree 3: 2 each + 2 shared on a third of the positions, no padded group.

  Sizes chosen so every other split is even (d_ff 24 = 3 x 8, vocabulary 48).
  """
  from ntp_jax.parallel.cost import own_shard_flops
  cfg = dataclasses.replace(UNROLLED, d_ff=24, ffn_granularity=1, vocab_size=48)
  job = _job(cfg, 4, 2, "1:2", 8)  # shares 4 and 3; the shared groups split by position
  reduced = [p for p in job.programs if p.replica_class.degree == 3][0]
  executed = class_step_flops(job, reduced, SEQ)
  cache = {}
  for position in range(3):
    need = own_shard_flops(cfg, reduced.replica_class, position, SEQ, cache,
                           lambda model, degree, share: _job(model, degree, 1, "", share))
    assert executed <= 1.02 * need, (position, executed, need)


def test_a_scanned_program_is_refused_not_miscounted():
  job = _job(SMALL, 4, 1, "", 4)
  with pytest.raises(ValueError, match="counts its body once"):
    class_step_flops(job, job.programs[0], SEQ)
