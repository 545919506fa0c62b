"""Executed flops per device (XLA cost analysis): healthy replicas pay nothing for a failure.

The figures come from one subprocess under the production codegen flags
(``tests/programs/class_flops.py``; ``tests/codegen.py`` says why).
"""

import functools
import json
import subprocess
import sys

import jax
import optax
import pytest
from flax import nnx
from helpers import ROOT, SMALL, process_env

from models.gpt import GPT, model_layouts
from ntp_jax.parallel.cost import class_step_flops
from ntp_jax.parallel.job_step import JobStep
from ntp_jax.parallel.plan import make_plan
from ntp_jax.parallel.programs import build_class_programs
from ntp_jax.train.config import parse_failed


def test_healthy_replicas_pay_nothing_and_reduced_ones_only_their_own_need():
  """One subprocess measures every figure (its start-up and compiles dominate)."""
  done = subprocess.run([sys.executable, "tests/programs/class_flops.py"], cwd=ROOT,
                        env=process_env(devices=8, codegen=False), capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  figures = json.loads(done.stdout.strip().splitlines()[-1])

  # dp=2 tp=4 with replica 1 at degree 3, then 2: the healthy class keeps its own block size,
  # at most 2 % over the healthy plan (the difference is the sync's reshard, which is per
  # parameter, not per token).
  healthy = figures["by_failed"][""]["4"]
  for failed, reduced_degree in (("1:2", 3), ("1:1,1:2", 2)):
    flops = figures["by_failed"][failed]
    assert set(flops) == {"4", str(reduced_degree)}, failed
    assert healthy <= flops["4"] <= 1.02 * healthy, (failed, flops["4"], healthy)

  # 8 KV groups at degree 3: 2 each + 2 shared on a third of the positions, no padded group;
  # every device of the reduced replica executes within 2 % of its own shard's need.
  executed, need = figures["reduced"]["executed"], figures["reduced"]["need"]
  assert len(need) == 3
  for position, own in enumerate(need):
    assert executed <= 1.02 * own, (position, executed, own)


def test_a_scanned_program_is_refused_not_miscounted():
  plan = make_plan(functools.partial(model_layouts, SMALL), tp=4, dp=1,
                   failed=parse_failed("", 1, 4), batch_size=4)
  programs = build_class_programs(plan, lambda layouts: GPT(SMALL, layouts, rngs=nnx.Rngs(0)),
                                  optax.adamw(1e-3), 1.0, 4 * 128, jax.devices()[:4])
  with pytest.raises(ValueError, match="counts its body once"):
    class_step_flops(JobStep(plan, programs), programs[0], 128)
