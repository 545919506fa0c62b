"""Llama-3-70B's degree-7 class step and cross-replica sync, lowered from shapes alone
(tests/integration/test_footprint.py). gpt_70b on 2 x 8 with slot 7 of replica 0 failed: TP
degrees 7 and 8, synced at t_min = 7. Prints one JSON line.

  XLA_FLAGS=--xla_force_host_platform_device_count=16 python tests/programs/lower_70b.py
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

import configs.gpt_70b  # noqa: E402
from models.gpt import GPTConfig, gpt_spec  # noqa: E402
from ntp_jax.parallel.steps import SplitStep, StepSettings, abstract_sync_blocks  # noqa: E402
from ntp_jax.parallel.sync import CrossClassSync  # noqa: E402
from ntp_jax.training.config import RunConfig, parse_failed  # noqa: E402
from ntp_jax.training.footprint import (  # noqa: E402
  abstract_program,
  check_split_step,
  sync_buffer_lengths,
)
from ntp_jax.training.loop import plan_for  # noqa: E402
from ntp_jax.training.optim import make_optimizer  # noqa: E402

config = configs.gpt_70b.get_config()
config.mesh.dp, config.mesh.tp = 2, 8
config.train.batch_size = 8
run = RunConfig.from_config(config)
spec = gpt_spec(GPTConfig.from_config(config.model), 0)
plan = plan_for(run, spec, parse_failed("0:7", 2, 8))
check_split_step(plan, spec, sharded=True)  # raises past int32 (the zero1 config's rows too)
optimizer = make_optimizer(run.train)
settings = StepSettings(optimizer, 1.0, plan.global_batch * config.train.seq_len)
degree_7 = next(c for c in plan.classes if c.degree == 7)
program, batch = abstract_program(plan, degree_7, spec.make, optimizer, config.train.seq_len,
                                  jax.devices())
step = SplitStep.build(program.graphdef, program.params, program.opt_state, program.mesh,
                       settings, plan.t_min)
grad, update = step.lower(program.params, program.opt_state, batch)
blocks = abstract_sync_blocks(step.grad, program.params, batch, program.mesh)
meshes = [abstract_program(plan, c, spec.make, optimizer, 1, jax.devices())[0].mesh
          for c in plan.classes]
sync = CrossClassSync(meshes, plan.t_min).lower([blocks])
print(json.dumps({
    "degrees": sorted(c.degree for c in plan.classes),
    "buffers": {name: list(shape) for name, shape in sync_buffer_lengths(plan, spec.make).items()},
    "class_buffers": {name: list(x.shape) for name, x in blocks.items()},
    "lowered": [bool(grad.as_text()), bool(update.as_text())],
    "sync_all_reduce": "all_reduce" in sync.as_text() or "all-reduce" in sync.as_text()}))
