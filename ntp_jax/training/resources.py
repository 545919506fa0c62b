"""Whether the devices can hold a plan's step, from shapes, before anything is allocated.

``train`` calls ``check_footprint`` after planning: with ``dry_run`` it
prints the per-device memory and flops of every class's step
(``training.footprint``) and stops; otherwise it does that work only when the
resident state takes more than a quarter of what the devices hold, and
stops with one line when the step cannot fit.
"""

from __future__ import annotations

import dataclasses

from ntp_jax.errors import ConfigError
from ntp_jax.model import ModelSpec
from ntp_jax.parallel.plan import Plan
from ntp_jax.training.config import RunConfig
from ntp_jax.training.footprint import (
  ClassFootprint,
  abstract_program,
  class_footprints,
  device_bytes,
  footprint_table,
  per_device_flops,
  resident_fraction,
  shortfall,
)


class ResourceError(ConfigError):
  """The devices cannot hold the plan's step (one line saying what it needs)."""


def resident_bytes(plan: Plan, make_model, optimizer, devices) -> list[int]:
  """Per class, bytes one device holds of parameters and optimizer state (shapes only)."""
  programs = [abstract_program(plan, c, make_model, optimizer, 1, devices)[0]
              for c in plan.classes]
  return [device_bytes(p.params) + device_bytes(p.opt_state) for p in programs]


def footprint(config: RunConfig, model: ModelSpec, plan: Plan, optimizer,
              devices) -> list[ClassFootprint]:
  """Per-device bytes and flops of every class's step (``footprint``), allocating nothing.

  Memory is that of the model as configured (scanned, rematerialised).
  Flops: with ``model.unrolled``, from the unrolled model at 2 and 3 layers,
  extended to ``model.n_layers`` (XLA counts a loop body once); otherwise
  the compiled program's own count.
  """
  args = (optimizer, config.train.clip_norm, config.train.seq_len, devices)
  footprints = class_footprints(plan, model.make, *args, loss=model.loss)
  if model.unrolled is None or model.n_layers is None:
    return footprints

  def flops_at(n_layers):
    small = model.unrolled(n_layers)
    return [f.flops for f in class_footprints(plan, small.make, *args, loss=small.loss,
                                              unrolled=True)]

  flops = per_device_flops(flops_at, model.n_layers)
  return [dataclasses.replace(f, flops=x) for f, x in zip(footprints, flops)]


def check_footprint(config: RunConfig, model: ModelSpec, plan: Plan, optimizer, devices,
                    log) -> list[ClassFootprint] | None:
  """The memory and compute plan, before anything is allocated.

  With ``dry_run`` it is printed and returned. Otherwise it is worked out
  only when the resident state (parameters and optimizer state, from shapes)
  takes more than a quarter of what the devices hold; then, if the step
  cannot fit, it is printed and the run stops.

  Raises:
    ResourceError: the devices cannot hold the step; the line says what it
      needs and what there is.
  """
  dry_run = config.dry_run
  resident = resident_bytes(plan, model.make, optimizer, devices)
  fraction = resident_fraction(plan, resident, devices)
  if not dry_run and (fraction is None or fraction <= 0.25):
    return None
  footprints = footprint(config, model, plan, optimizer, devices)
  tokens = plan.global_batch * config.train.seq_len
  log(plan.describe())
  log(footprint_table(footprints))
  log(f"tokens per step: {tokens:,}; model flops per token "
      f"(6 x parameters): {6 * model.param_count:.3e}")
  problem = shortfall(footprints, devices)
  if dry_run:
    log(f"dry run: {problem or 'the devices can hold this plan'}")
    return footprints
  if problem:
    raise ResourceError(f"{problem} (the plan above; --config.dry_run=True prints it only)")
  return footprints
