"""Executed flops per device of a job's step, from XLA's cost analysis.

XLA compiles one SPMD program per replica class; its cost analysis reports
the flops *each device* of that program executes (padded blocks included).
This is the noise-free way to measure wasted compute on a CPU host.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.mesh import DP, TP
from ntp_jax.replica_class import ClassProgram, JobStep


def compiled_flops(lowered: Any) -> float:
  """Per-device flops of a lowered program (``jitted.lower(...)``)."""
  analysis = lowered.compile().cost_analysis()
  if isinstance(analysis, (list, tuple)):  # older JAX returns one dict per program
    analysis = analysis[0]
  return float(analysis.get("flops", 0.0))


def class_step_flops(job: JobStep, program: ClassProgram, seq_len: int) -> float:
  """Flops one device of ``program``'s class executes in one training step.

  For a single-class job this is the fused step; with several classes it is
  the class's gradient half plus its update half (the cross-class
  all-reduce adds one addition per synced element and is counted apart).
  """
  rows = program.replica_class.batch_rows
  batch = jax.ShapeDtypeStruct((rows, seq_len + 1), np.int32, sharding=program.batch_sharding)
  if program.step is not None:
    return compiled_flops(program.step.lower(program.params, program.opt_state, batch))
  grad_flops = compiled_flops(program.grad.lower(program.params, batch))
  _, blocks = jax.eval_shape(program.grad, program.params, batch)
  block_sharding = NamedSharding(program.mesh, P(DP, TP))
  blocks = {k: jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=block_sharding)
            for k, b in blocks.items()}
  update_flops = compiled_flops(program.update.lower(program.params, program.opt_state, blocks))
  return grad_flops + update_flops
