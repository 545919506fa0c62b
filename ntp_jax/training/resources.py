"""Whether the devices can hold a plan's step, from shapes, before anything is allocated.

``train`` calls ``check_footprint`` after planning: with ``dry_run`` it
prints the per-device memory and flops of every class's step and a save's
peak (``training.footprint``), the same for the plan one failed slot leads
to, and one line on whether each fits a device and, if not, at which DP the
configured optimizer state would (``fit_line``), and stops; otherwise it
does that work only when the resident state takes more than a quarter of
what the devices hold, and stops with one line when the step cannot fit.
Every figure counts the optimizer state as the configured choice
(``train.optimizer_sharding``, ``optimizer_copies``) keeps it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ntp_jax.errors import ConfigError
from ntp_jax.model import ModelSpec
from ntp_jax.parallel.plan import Plan
from ntp_jax.parallel.zero import ZeroSettings, piece_count, piece_elements
from ntp_jax.training.config import RunConfig
from ntp_jax.training.footprint import (
  ClassFootprint,
  abstract_program,
  class_footprints,
  device_bytes,
  device_capacity,
  footprint_table,
  memoized_sync_lengths,
  per_device_flops,
  piece_element_bytes,
  resident_fraction,
  shortfall,
  zero_state_bytes,
)
from ntp_jax.training.loop import plan_for
from ntp_jax.training.optim import zero_settings

GIB = 2 ** 30
# The comparison's device on a CPU host (or an accelerator that does not say): an 80 GB GPU.
REFERENCE_DEVICE_BYTES = 80 * GIB


class ResourceError(ConfigError):
  """The devices cannot hold the plan's step (one line saying what it needs)."""


def resident_bytes(plan: Plan, make_model, optimizer, devices, *,
                   zero: ZeroSettings | None = None) -> list[int]:
  """Per class, bytes one device holds of parameters and optimizer state (shapes only).

  ``zero``: the sharded optimizer (``optim.zero_settings``); its state is counted for
  a core device (the most any device holds). Default: replicated.

  Raises:
    ValueError: ``zero`` asks for more copies than live replicas.
  """
  programs = [abstract_program(plan, c, make_model, optimizer, 1, devices)[0]
              for c in plan.classes]
  if zero is None:
    return [device_bytes(p.params) + device_bytes(p.opt_state) for p in programs]
  state = zero_state_bytes(plan, make_model, devices, zero)
  return [device_bytes(p.params) + state for p in programs]


def measured_footprints(config: RunConfig, model: ModelSpec, plan: Plan, optimizer, devices,
                        zero: ZeroSettings | None, *, compiled: dict | None = None
                        ) -> list[ClassFootprint]:
  """``class_footprints`` of the model as configured, at full depth (flops as compiled).

  Args:
    zero: the sharded optimizer (None: replicated).
    compiled: a memo shared with other calls on this config and model.

  Raises:
    ResourceError: the step's programs cannot be built (``OverflowError``: a run past
      int32 indexing, ``footprint.split_step_overrun``), one line.
  """
  memo = {} if compiled is None else compiled
  try:
    return class_footprints(plan, model.make, optimizer, config.train.clip_norm,
                            config.train.seq_len, devices, loss=model.loss, zero=zero,
                            compiled=memo.setdefault(("layers", model.n_layers), {}))
  except OverflowError as err:
    raise ResourceError(f"the step's programs cannot be built for this model: {err}") from None


def footprint(config: RunConfig, model: ModelSpec, plan: Plan, optimizer,
              devices, *, compiled: dict | None = None) -> list[ClassFootprint]:
  """Per-device bytes and flops of every class's step (``footprint``), allocating nothing,
  with the optimizer state of ``config.train`` (``optimizer_sharding``, ``optimizer_copies``).

  Memory is that of the model as configured (scanned, rematerialised;
  ``measured_footprints``). Flops: with ``model.unrolled``, from the unrolled model at
  2 and 3 layers, extended to ``model.n_layers`` (XLA counts a loop body once);
  otherwise the compiled program's own count. ``compiled``: a memo shared with other
  calls on this config and model.

  Raises:
    ResourceError: the step's programs cannot be built (``measured_footprints``).
  """
  zero = zero_settings(config.train)
  args = (optimizer, config.train.clip_norm, config.train.seq_len, devices)
  footprints = measured_footprints(config, model, plan, optimizer, devices, zero,
                                   compiled=compiled)
  if model.unrolled is None or model.n_layers is None:
    return footprints

  def flops_at(n_layers):
    small = model.unrolled(n_layers)
    return [f.flops for f in class_footprints(plan, small.make, *args, loss=small.loss,
                                              unrolled=True, zero=zero)]

  flops = per_device_flops(flops_at, model.n_layers)
  return [dataclasses.replace(f, flops=x) for f, x in zip(footprints, flops)]


def sharded_state_bytes(zero: ZeroSettings, lengths: dict[str, tuple[int, ...]],
                        element_bytes: dict[str, int], replicas: int) -> int:
  """A core device's sharded state with ``replicas`` live replicas: a piece of each sync
  buffer (``zero.piece_elements``; ``lengths``: ``footprint.sync_buffer_lengths``) times the
  state's bytes per piece element (``footprint.piece_element_bytes``)."""
  pieces = piece_count(replicas, zero.copies)
  return sum(piece_elements(shape, pieces) * element_bytes[name]
             for name, shape in lengths.items())


def smallest_dp(fullest: ClassFootprint, replicas: int, zero: ZeroSettings,
                lengths: dict[str, tuple[int, ...]], element_bytes: dict[str, int],
                capacity: int, limit: int = 4096) -> int | None:
  """The fewest replicas at which a sharded state (``zero``) lets ``fullest`` (the device
  that needs the most, on a plan of ``replicas`` live replicas) fit ``capacity`` bytes,
  each replica keeping its batch share, with the temporaries and outputs measured on this
  mesh (an upper bound: the update's piece-sized temporaries only shrink with more
  replicas); None when none up to ``limit`` does."""
  # What does not shrink with more replicas (the step counts included).
  base = fullest.need - sharded_state_bytes(zero, lengths, element_bytes, replicas)
  for replicas in range(zero.copies, limit + 1):
    if base + sharded_state_bytes(zero, lengths, element_bytes, replicas) <= capacity:
      return replicas
  return None


def comparison_capacity(devices: Sequence[Any]) -> tuple[int, str]:
  """Bytes per device the fit is judged against, and what they are: an accelerator's
  ``bytes_limit``; on CPU (or when unknown) an 80 GB GPU's 80 GiB."""
  if devices[0].platform != "cpu":
    capacity = device_capacity(devices[0])
    if capacity is not None:
      return capacity, f"{devices[0].device_kind}"
  return REFERENCE_DEVICE_BYTES, "an 80 GB GPU"


def fit_line(config: RunConfig, model: ModelSpec, plans: Sequence[tuple[str, Plan, list]],
             devices: Sequence[Any], compiled: dict) -> str:
  """One line: whether the configured optimizer state's plans (``(name, plan, footprints)``)
  fit a device (``comparison_capacity``), each with what its fullest device needs (a step's
  peak or a save's), and what would fit: with a sharded state, the smallest DP
  (``smallest_dp``) or the bytes that no DP shrinks."""
  capacity, device = comparison_capacity(devices)
  zero = zero_settings(config.train)
  parts, widest = [], None
  for name, plan, footprints in plans:
    fullest = max(footprints, key=lambda f: f.need)
    where = "a save" if fullest.need > fullest.peak else "a step"
    parts.append(f"{name} (TP {plan.t_min}) {'yes' if fullest.need <= capacity else 'no'}, "
                 f"{fullest.need / GIB:.1f} GiB in {where}")
    if widest is None or fullest.need > widest[1].need:
      widest = (plan, fullest)
  line = f"fits {capacity / GIB:.0f} GiB per device ({device}): " + "; ".join(parts)
  if widest[1].need <= capacity:
    return line
  if zero is None:
    return line + ("; a replicated optimizer state does not shrink with DP "
                   "(train.optimizer_sharding=zero1 or zero2 splits it over the replicas)")
  plan, fullest = widest
  memo = compiled.setdefault(("layers", model.n_layers), {})
  lengths = memoized_sync_lengths(memo, plan, model.make)
  element = piece_element_bytes(plan, model.make, devices, zero, lengths)
  dp = smallest_dp(fullest, len(plan.replicas), zero, lengths, element, capacity)
  if dp is not None:
    return line + f"; {zero.name} k={zero.copies} fits from DP {dp} (same batch share per replica)"
  return line + (f"; at no DP: {(fullest.need - fullest.opt_state) / GIB:.1f} GiB per device "
                 "besides the optimizer state pieces")


def check_footprint(config: RunConfig, model: ModelSpec, plan: Plan, optimizer, devices,
                    log: Callable[[str], None]) -> list[ClassFootprint] | None:
  """The memory and compute plan, before anything is allocated.

  With ``dry_run`` it is printed and returned (with several replicas, followed by the
  plan one failed slot leads to and ``fit_line``). Otherwise it is worked out only when the
  resident state (parameters and optimizer state, from shapes) takes more than a
  quarter of what the devices hold; then, if the step cannot fit, it is printed and the
  run stops. The optimizer state is the configured choice's (``train.optimizer_sharding``).

  Raises:
    ResourceError: the devices cannot hold the step; the line says what it
      needs and what there is.
  """
  dry_run = config.dry_run
  zero = zero_settings(config.train)
  resident = resident_bytes(plan, model.make, optimizer, devices, zero=zero)
  fraction = resident_fraction(plan, resident, devices)
  if not dry_run and (fraction is None or fraction <= 0.25):
    return None
  compiled: dict = {}
  footprints = footprint(config, model, plan, optimizer, devices, compiled=compiled)
  tokens = plan.global_batch * config.train.seq_len
  log(plan.describe())
  log(footprint_table(footprints))
  log(f"tokens per step: {tokens:,}; model flops per token "
      f"(6 x parameters): {6 * model.param_count:.3e}")
  problem = shortfall(footprints, devices)
  if dry_run:
    plans = [("this plan" if config.ntp.failed else "healthy", plan, footprints)]
    if not config.ntp.failed and config.mesh.tp > 1:  # where the first failure leads
      failed = plan_for(config, model, frozenset({(0, config.mesh.tp - 1)}))
      # Memory only: its flops would take four more compiles of unrolled models.
      degraded = measured_footprints(config, model, failed, optimizer, devices,
                                     zero_settings(config.train), compiled=compiled)
      degraded = [dataclasses.replace(f, flops=None) for f in degraded]
      log(f"after a failed slot (replica 0's last): {failed.describe().splitlines()[0]}")
      log(footprint_table(degraded))
      plans.append(("1 failed slot", failed, degraded))
    log(fit_line(config, model, plans, devices, compiled))
    log(f"dry run: {problem or 'the devices can hold this plan'}")
    return footprints
  if problem:
    raise ResourceError(f"{problem} (the plan above; --config.dry_run=True prints it only)")
  return footprints
