"""Executed flops per device (XLA cost analysis): healthy replicas pay nothing for a failure.

The figures come from one subprocess under the production HLO passes
(``tests/programs/class_flops.py``; ``tests/codegen.py`` says why).
"""

import json
import subprocess
import sys

import pytest
from helpers import ROOT, SMALL, process_env
from programs.class_flops import SEQ, job

from ntp_jax.analysis.cost import class_step_flops


def test_healthy_replicas_pay_nothing_and_reduced_ones_only_their_own_need():
  """One subprocess measures every figure (its start-up and compiles dominate)."""
  done = subprocess.run([sys.executable, "tests/programs/class_flops.py"], cwd=ROOT,
                        env=process_env(devices=8, codegen="cost"), capture_output=True,
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
  step = job(SMALL, 4, 1, "", 4)
  with pytest.raises(ValueError, match="counts its body once"):
    class_step_flops(step, step.programs[0], SEQ)
