"""Replicas of mixed TP degree (4 + 3 + 2, 8 + 5, 8 + 7 + 6) against a single device, in a
subprocess of up to 24 simulated devices. (8 + 7 alone: its two classes are among 8 + 7 + 6's.)"""

import json
import subprocess
import sys

import numpy as np
from helpers import ROOT, process_env

STEPS = 5  # plain SGD: every step's update shows in the parameters compared
MIXED = [  # (tp, dp, failed slots, TP degrees of the replicas)
    (4, 3, "1:3,2:2,2:3", [4, 3, 2]),
    (8, 2, "1:1,1:2,1:4", [8, 5]),
    (8, 3, "1:5,2:0,2:7", [8, 7, 6]),
]


def test_mixed_degrees_match_single_device_in_subprocess():
  """Needs up to 24 devices: one subprocess of its own device count runs every plan of
  ``MIXED`` (one start-up, and one single-device reference per batch size).

  Plain SGD here: the parameters are compared to 2e-6 absolute.
  """
  code = f"""
import json, sys
import jax, numpy as np, optax
sys.path.insert(0, "tests")  # the repository root is the working directory
from helpers import run_job
sgd, refs = optax.sgd(0.5), {{}}
for tp, dp, failed in {[(tp, dp, failed) for tp, dp, failed, _ in MIXED]!r}:
  if dp not in refs:
    refs[dp] = run_job(tp=1, dp=1, steps={STEPS}, batch_size=2 * dp, optimizer=sgd)
  ref = refs[dp]
  out = run_job(tp=tp, dp=dp, failed=failed, steps={STEPS}, batch_size=2 * dp, optimizer=sgd)
  diff = max(float(np.max(np.abs(a - b))) for p in out[2]
             for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref[2][0])))
  print(json.dumps(dict(ref=ref[0], out=out[0], diff=diff,
                        degrees=[r.degree for r in out[1].replicas])), flush=True)
"""
  devices = max(tp * dp for tp, dp, _, _ in MIXED)
  env = process_env(devices=devices)
  result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  reports = [json.loads(line) for line in result.stdout.strip().splitlines()[-len(MIXED):]]
  for (tp, dp, failed, degrees), report in zip(MIXED, reports):
    assert report["degrees"] == degrees, (tp, dp, failed)
    np.testing.assert_allclose(report["out"], report["ref"], rtol=2e-5)
    assert report["diff"] < 2e-6, (tp, dp, failed, report)
