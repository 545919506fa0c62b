"""Executed flops per device (XLA cost analysis): healthy replicas pay nothing for a failure."""

import functools

import jax
import optax
import pytest
from flax import nnx

from job_harness import SMALL
from models.gpt import GPT, model_layouts
from ntp_jax.cost import class_step_flops
from ntp_jax.plan import make_plan
from ntp_jax.replica_class import JobStep, build_class_programs

SEQ = 128  # enough tokens that per-step work dominates the per-parameter sync work


def _flops_by_class(failed):
  plan = make_plan(functools.partial(model_layouts, SMALL), tp=4, dp=2, failed=failed,
                   batch_size=8)
  programs = build_class_programs(plan, lambda layouts: GPT(SMALL, layouts, rngs=nnx.Rngs(0)),
                                  optax.adamw(1e-3), 1.0, plan.global_batch * SEQ,
                                  jax.devices()[:8])
  job = JobStep(plan, programs)
  return {p.replica_class.degree: class_step_flops(job, p, SEQ) for p in programs}


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

