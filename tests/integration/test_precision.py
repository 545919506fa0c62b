"""Mixed precision: fp32 master parameters and Adam moments, bf16 compute, fp32 loss.

Measured in one subprocess under the production codegen flags (``tests/codegen.py``):
numerics are the point, and 300 steps run faster there.
"""

import json
import subprocess
import sys

import numpy as np
from helpers import ROOT, process_env


def test_bf16_compute_tracks_fp32_over_150_steps(tmp_path):
  done = subprocess.run([sys.executable, "tests/programs/bf16_vs_fp32.py", str(tmp_path)],
                        cwd=ROOT, env=process_env(devices=1, codegen=False),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(done.stdout.strip().splitlines()[-1])
  fp32, bf16 = (np.asarray(report["losses"][d]) for d in ("float32", "bfloat16"))
  assert len(bf16) == 150 and np.all(np.isfinite(bf16))
  assert not np.array_equal(fp32, bf16)  # the bf16 run really computed in bf16
  assert abs(bf16[-1] - fp32[-1]) / fp32[-1] < 0.02, (bf16[-1], fp32[-1])
  assert bf16[-1] < 0.6 * bf16[0]  # and it learned
  assert report["param_dtypes"] == ["float32"]
  assert report["moment_dtypes"] == ["float32"]
  assert report["bf16_in_hlo"]
