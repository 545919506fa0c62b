"""Executed flops per device of a job's step, from XLA's cost analysis.

XLA compiles one SPMD program per replica class; its cost analysis reports
the flops *each device* of that program executes (padded blocks included).
This is the noise-free way to measure wasted compute on a CPU host.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ntp_jax.parallel.job_step import JobStep
from ntp_jax.parallel.programs import ClassProgram


def compiled_flops(lowered: Any) -> float:
  """Per-device flops of a lowered program (``jitted.lower(...)``).

  Raises:
    ValueError: the program has a loop (scanned layers): XLA's cost analysis
      counts a loop body once; measure the unrolled model
      (``model.scan_layers=False``) or see ``footprint.per_device_flops``.
  """
  compiled = lowered.compile()
  if " while(" in compiled.as_text():
    raise ValueError("cost analysis of a program with a loop counts its body once; "
                     "measure the unrolled model (model.scan_layers=False)")
  return flops_of(compiled)


def flops_of(compiled: Any) -> float:
  """Per-device flops XLA's cost analysis gives a compiled program (a loop body counted once)."""
  analysis = compiled.cost_analysis()
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
  return sum(compiled_flops(lowered)
             for lowered in program.step.lower(program.params, program.opt_state, batch))


def own_shard_flops(cfg, replica_class, position: int, seq_len: int, cache: dict,
                    build_job: Callable[[Any, int, int], JobStep]) -> float:
  """Flops one device's own shard needs in a step.

  That is the per-device flops of the same step for a uniform TP group
  (``replica_class.degree`` slots, the class's batch share) whose every slot
  holds exactly this device's units of heads, MLP and vocabulary. A shared
  KV group counts for ``1 / degree`` of a group (each slot computes it on
  that fraction of the positions); attention work is linear in groups, so the
  need is interpolated between the uniform steps at ``k`` and ``k + 1`` groups.

  Args:
    cfg: the model's ``GPTConfig``.
    replica_class: the device's class; position: its index among live slots.
    seq_len: tokens per sequence. cache: memo of compiled uniform steps.
    build_job: ``(uniform cfg, degree, batch share) -> JobStep`` of one class.
  """
  layouts = replica_class.layouts
  degree, share = replica_class.degree, replica_class.batch_share
  heads, ffn, vocab = (layouts.heads.units[position], layouts.ffn.units[position],
                       layouts.vocab.units[position])

  def uniform(kv_groups):
    key = (degree, kv_groups, ffn, vocab, share, seq_len)
    if key not in cache:
      group = cfg.n_heads // cfg.n_kv_heads
      model = dataclasses.replace(
          cfg, n_kv_heads=degree * kv_groups, n_heads=degree * kv_groups * group,
          d_ff=degree * ffn * cfg.ffn_granularity,
          vocab_size=degree * vocab * cfg.vocab_granularity)
      job = build_job(model, degree, share)
      cache[key] = class_step_flops(job, job.programs[0], seq_len)
    return cache[key]

  base = uniform(heads)
  if not layouts.heads.shared_units:
    return base
  return base + (uniform(heads + 1) - base) * layouts.heads.shared_units / degree
