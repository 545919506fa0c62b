"""Whether the devices can hold a plan's step, from shapes, before anything is allocated.

``train`` calls ``check_footprint`` after planning: with ``dry_run`` it
prints the per-device memory and flops of every class's step
(``training.footprint``), and with several replicas a comparison of the
optimizer-state choices (``train.optimizer_sharding``, ``optimizer_copies``)
healthy and with one failed slot (``optimizer_choices``), and stops;
otherwise it does that work only when the resident state takes more than a
quarter of what the devices hold, and stops with one line when the step
cannot fit. Every figure counts the optimizer state as the configured choice
keeps it.
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
  optimizer_label,
  per_device_flops,
  piece_element_bytes,
  resident_fraction,
  shortfall,
  zero_state_bytes,
)
from ntp_jax.training.loop import plan_for
from ntp_jax.training.optim import make_optimizer, zero_settings

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
    ResourceError: the step cannot be built and cannot be measured at fewer layers.
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


@dataclasses.dataclass(frozen=True)
class Choice:
  """One optimizer-state choice on one plan: its fullest device.

  Attributes:
    plan: ``healthy`` or ``1 failed slot``; degree: its smallest TP degree.
    zero: the sharded optimizer (None: replicated).
    optimizer: its label (``footprint.optimizer_label``).
    worst: the class footprint that needs the most (``ClassFootprint.need``: a step's
      peak or a save's); ``base`` is that less its optimizer state (bytes), the part that
      does not shrink with more replicas.
    lengths, element_bytes: with ``zero``, the sync buffers' shapes at one position
      (``footprint.sync_buffer_lengths``) and the state's bytes per piece element of each
      (for ``smallest_dp``); else empty.
  """

  plan: str
  degree: int
  zero: ZeroSettings | None
  optimizer: str
  worst: ClassFootprint
  lengths: dict[str, tuple[int, ...]]
  element_bytes: dict[str, int]

  @property
  def base(self) -> int:
    return self.worst.need - self.worst.opt_state


def _choices(config: RunConfig) -> list[ZeroSettings | None]:
  """Replicated, then zero1 and zero2 each with one copy, and with two when there are two
  replicas."""
  out: list[ZeroSettings | None] = [None]
  for sharding in ("zero1", "zero2"):
    for copies in (1, 2)[:config.mesh.dp]:
      out.append(zero_settings(dataclasses.replace(config.train, optimizer_sharding=sharding,
                                                   optimizer_copies=copies)))
  return out


def optimizer_choices(config: RunConfig, model: ModelSpec, devices: Sequence[Any], *,
                      compiled: dict | None = None) -> list[Choice]:
  """Per-device memory of each optimizer-state choice (replicated; zero1 and zero2 with 1
  copy, and 2 with two replicas or more) on ``config``'s mesh, healthy and with one failed slot
  (replica 0's last; none with ``mesh.tp=1``). Abstract shapes only: each class's programs
  compiled once for every choice, at full depth (``class_footprints``; ``compiled`` shared
  with the caller's own footprint of the configured plan).

  Raises:
    ValueError: a choice asks for more copies than live replicas.
    ResourceError: a choice's step cannot be built.
  """
  memo = {} if compiled is None else compiled
  failed = [("healthy", frozenset())]
  if config.mesh.tp > 1:
    failed.append(("1 failed slot", frozenset({(0, config.mesh.tp - 1)})))
  optimizer = make_optimizer(config.train)  # the replicated class state's (masked AdamW)
  cases = [(name, plan_for(config, model, slots), zero)
           for name, slots in failed for zero in _choices(config)]

  out = []
  for name, plan, zero in cases:
    worst = max(measured_footprints(config, model, plan, optimizer, devices, zero,
                                    compiled=memo), key=lambda f: f.need)
    lengths, element = {}, {}
    if zero is not None:  # the same for every choice on the plan
      lengths = memoized_sync_lengths(memo.setdefault(("layers", model.n_layers), {}), plan,
                                      model.make)
      element = piece_element_bytes(plan, model.make, devices, zero, lengths)
    out.append(Choice(name, plan.t_min, zero, optimizer_label(zero, len(plan.replicas)),
                      worst, lengths, element))
  return out


def choice_state_bytes(choice: Choice, replicas: int) -> int:
  """A core device's sharded state for ``choice`` (zero1 or zero2) with ``replicas`` live replicas:
  a piece of each buffer (``zero.piece_elements``) times the state's bytes per element."""
  pieces = piece_count(replicas, choice.zero.copies)
  return sum(piece_elements(shape, pieces) * choice.element_bytes[name]
             for name, shape in choice.lengths.items())


def smallest_dp(choice: Choice, capacity: int, limit: int = 4096) -> int | None:
  """The fewest replicas at which ``choice`` (zero1 or zero2) fits ``capacity`` bytes per
  device, each replica keeping its batch share and micro-batches, with the temporaries and
  outputs measured on this mesh (the update's piece-sized temporaries and zero2's summed
  pieces only shrink with more replicas: an upper bound); None when none up to ``limit``
  does."""
  for replicas in range(choice.zero.copies, limit + 1):
    if choice.base + choice_state_bytes(choice, replicas) <= capacity:
      return replicas
  return None


def comparison_capacity(devices: Sequence[Any]) -> tuple[int, str]:
  """Bytes per device the comparison is held against, and what they are: an accelerator's
  ``bytes_limit``; on CPU (or when unknown) an 80 GB GPU's 80 GiB."""
  if devices[0].platform != "cpu":
    capacity = device_capacity(devices[0])
    if capacity is not None:
      return capacity, f"{devices[0].device_kind}"
  return REFERENCE_DEVICE_BYTES, "an 80 GB GPU"


def comparison_table(choices: Sequence[Choice], capacity: int, device: str, tp: int,
                     dp: int) -> str:
  """The choices as one table (per-device GiB of the fullest device of each plan), which
  fits ``capacity`` at each TP degree, and, when no sharded choice fits, the smallest DP
  at which the one with the least besides its state would."""
  header = ("plan", "fullest device's TP degree", "optimizer", "params", "grads", "opt state",
            "temp", "outputs", "peak", "save peak", f"fits {capacity / GIB:.0f} GiB")
  rows = []
  for c in choices:
    f = c.worst
    rows.append((f"{c.plan} (TP {c.degree})" if c.plan != "healthy" else c.plan,
                 str(f.replica_class.degree), c.optimizer,
                 *(f"{b / GIB:.3f}" for b in (f.params, f.grads, f.opt_state, f.temp, f.outputs,
                                               f.peak, f.save_peak)),
                 "yes" if f.need <= capacity else "no"))
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
  fmt = "  ".join(f"{{:<{w}}}" if i < 3 else f"{{:>{w}}}" for i, w in enumerate(widths))
  lines = [f"optimizer state choices on {dp} x {tp}, per device (GiB, the fullest device of "
           f"each plan; zero1/zero2: a core device) against {capacity / GIB:.0f} GiB ({device}):",
           fmt.format(*header)] + [fmt.format(*r) for r in rows]
  lines.append("peak: params + opt state + batch + temp + outputs (grads live inside temp; "
               "outputs: what the step's programs give back beside their donated inputs); "
               "save peak: params + opt state + the state read back into the class layout "
               "by a save or a live move (zero1/zero2)")
  for plan in dict.fromkeys(c.plan for c in choices):
    mine = [c for c in choices if c.plan == plan]
    fitting = [c.optimizer for c in mine if c.worst.need <= capacity]
    lines.append(f"fits {capacity / GIB:.0f} GiB per device, {plan} (TP degree {mine[0].degree}): "
                 + (", ".join(fitting) if fitting else "none"))
    sharded = [c for c in mine if c.zero is not None]
    if sharded and not any(c.worst.need <= capacity for c in sharded):
      best = min(sharded, key=lambda c: (c.zero.copies, c.base))
      dp_fit = smallest_dp(best, capacity)
      lines.append(
          f"  {best.zero.name} k={best.zero.copies} fits from DP {dp_fit} (same batch share "
          "per replica)" if dp_fit is not None else
          f"  no DP fits: {best.zero.name} k={best.zero.copies}, the least besides its "
          f"optimizer state pieces, needs {best.base / GIB:.1f} GiB per device "
          + ("for parameters, batch, temporaries and outputs alone"
             if best.worst.need == best.worst.peak else
             "in a save, for parameters and the state read back into the class layout"))
  return "\n".join(lines)


def check_footprint(config: RunConfig, model: ModelSpec, plan: Plan, optimizer, devices,
                    log: Callable[[str], None]) -> list[ClassFootprint] | None:
  """The memory and compute plan, before anything is allocated.

  With ``dry_run`` it is printed and returned (with several replicas, followed by
  ``optimizer_choices`` as one table). Otherwise it is worked out only when the
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
    if config.mesh.dp > 1:
      capacity, device = comparison_capacity(devices)
      log(comparison_table(optimizer_choices(config, model, devices, compiled=compiled),
                           capacity, device, config.mesh.tp, config.mesh.dp))
    log(f"dry run: {problem or 'the devices can hold this plan'}")
    return footprints
  if problem:
    raise ResourceError(f"{problem} (the plan above; --config.dry_run=True prints it only)")
  return footprints
