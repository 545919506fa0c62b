"""gpt_micro for 150 steps on one device in float32 and in bfloat16 compute, under the
production codegen flags (tests/codegen.py), for tests/integration/test_precision.py.

  python tests/programs/bf16_vs_fp32.py WORKDIR

Prints one JSON line: both runs' losses, the dtypes of the bf16 run's parameters and Adam
moments, and whether its lowered step computes in bf16.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import jax  # noqa: E402
import numpy as np  # noqa: E402
from helpers import micro_config  # noqa: E402

from ntp_jax.training.trainer import train  # noqa: E402

STEPS = 150

if __name__ == "__main__":
  runs = {}
  for dtype in ("float32", "bfloat16"):
    # One device: precision is the point here; the TP paths are the same code in bf16.
    config = micro_config(sys.argv[1], **{"train.steps": STEPS, "mesh.tp": 1,
                                         "model.dtype": dtype, "train.log_every": 50,
                                         "train.schedule_steps": 0})  # the run's own curve
    runs[dtype] = train(config, log=lambda *_: None)
  program = runs["bfloat16"].programs[0]
  shape = (config.train.batch_size, config.train.seq_len + 1)  # inputs and shifted targets
  batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=program.batch_sharding)
  [lowered] = program.step.lower(program.params, program.opt_state, batch)
  print(json.dumps({
      "losses": {d: r.losses for d, r in runs.items()},
      "param_dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(program.params)}),
      "moment_dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(program.opt_state)
                               if x.ndim > 0}),
      "bf16_in_hlo": "bf16" in lowered.as_text()}))
