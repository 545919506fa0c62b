"""The job's placement: replicas, their live slots and classes, and batch shares.

A job has ``dp`` DP replicas of ``tp`` slots each. After failures a replica
keeps its live slots and trains at TP degree ``t = live slots`` (NTP); a
replica with no live slot is dropped. Replicas whose layouts split the
model the same way (same degree and speed weights, whichever slots failed)
form a *replica class*, which runs one compiled program over its own
sub-mesh. Batch shares keep every live device equally
busy: ``proportional`` gives a replica at degree ``t`` about ``t/T`` of a
healthy replica's sequences (``t / t_max`` of the fastest replica's share when
no replica is healthy, so a lone reduced replica keeps the full batch).
Source: Arfeen et al., arXiv:2504.06095, Sec. 4.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from ntp_jax.errors import ConfigError
from ntp_jax.sharding.layout import live_slots as live_slots_of

REBALANCE = ("proportional", "equal")


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
  """One live DP replica."""

  replica: int  # DP index in the job
  live_slots: tuple[int, ...]
  batch_share: int  # sequences per step
  class_index: int

  @property
  def degree(self) -> int:
    return len(self.live_slots)


@dataclasses.dataclass(frozen=True)
class ReplicaClass:
  """Replicas sharing one layout: one compiled program over a ``(replicas, degree)`` mesh.

  The replicas may have lost different slots: a layout is a unit split over
  the live slots in order, whichever slots those are.
  """

  index: int
  live_slots: tuple[tuple[int, ...], ...]  # per replica, in ``replicas`` order
  replicas: tuple[int, ...]
  layouts: Any  # the model's layouts for these live slots (e.g. models.gpt.ModelLayouts)
  batch_share: int  # sequences per replica per step

  @property
  def degree(self) -> int:
    return len(self.live_slots[0])

  @property
  def batch_rows(self) -> int:
    return self.batch_share * len(self.replicas)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The whole job's placement for one failure state."""

  tp: int
  dp: int
  replicas: tuple[ReplicaPlan, ...]  # live replicas, ascending
  dropped: tuple[int, ...]  # replicas with every slot failed
  classes: tuple[ReplicaClass, ...]
  rebalance: str
  logical_layouts: Any = None  # the model's layouts over one slot: its logical form

  def summary(self) -> dict:
    """JSON-ready description (stored beside checkpoints): mesh, live slots, degrees."""
    return {"tp": self.tp, "dp": self.dp, "rebalance": self.rebalance,
            "replicas": [{"replica": r.replica, "live_slots": list(r.live_slots),
                          "batch_share": r.batch_share} for r in self.replicas],
            "dropped": list(self.dropped), "global_batch": self.global_batch}

  @property
  def global_batch(self) -> int:
    """Sequences per step over all live replicas."""
    return sum(r.batch_share for r in self.replicas)

  @property
  def live_devices(self) -> int:
    return sum(r.degree for r in self.replicas)

  def class_rows(self) -> list[tuple[int, int]]:
    """``(start, stop)`` rows of the step's global batch for each class, in class order."""
    rows, start = [], 0
    for c in self.classes:
      rows.append((start, start + c.batch_rows))
      start += c.batch_rows
    return rows

  def describe(self) -> str:
    """Multi-line table: one line per replica (live slots, degree, class, share)."""
    lines = [f"plan: {self.dp} DP replica(s) x {self.tp} slots, {self.live_devices} live devices, "
             f"{self.global_batch} sequences per step ({self.rebalance} batch shares)"]
    for r in self.replicas:
      state = "healthy" if r.degree == self.tp else "reduced"
      lines.append(f"  replica {r.replica}: TP degree {r.degree} ({state}), live slots "
                   f"{','.join(map(str, r.live_slots))}, class {r.class_index}, "
                   f"batch share {r.batch_share}")
    for d in self.dropped:
      lines.append(f"  replica {d}: dropped (every slot failed)")
    if len(self.replicas) > 1:
      lines.append(f"  peer groups (gradient all-reduce across replicas, {self.t_min} core slots "
                   "per replica):")
      for j, group in enumerate(self.peer_groups()):
        lines.append(f"    group {j}: " + ", ".join(f"replica {r} slot {s}" for r, s in group))
    return "\n".join(lines)

  @property
  def t_min(self) -> int:
    """The smallest TP degree of any live replica: core slots per replica."""
    return min(r.degree for r in self.replicas)

  def peer_groups(self) -> list[list[tuple[int, int]]]:
    """``(replica, slot)`` members of each peer group: the ``j``-th live slot of every replica."""
    return [[(r.replica, r.live_slots[j]) for r in self.replicas] for j in range(self.t_min)]


def parse_failed(text: str, dp: int, tp: int) -> dict[int, tuple[int, ...]]:
  """``ntp.failed`` -> failed slots per replica.

  Accepts ``""``, bare slots of replica 0 (``"3"``, ``"3,5"``) and
  ``replica:slot`` pairs (``"1:3"``, ``"0:2,1:5,1:6"``), mixed freely.

  Raises:
    ConfigError: a malformed item, an unknown replica or slot, a duplicated pair.
  """
  text = str(text).strip()
  failed: dict[int, list[int]] = {}
  if not text:
    return {}
  for item in text.split(","):
    item = item.strip()
    match = re.fullmatch(r"(?:(\d+):)?(\d+)", item)
    if not match:
      raise ConfigError(f"ntp.failed: {item!r} is not a slot ('3') or a replica:slot pair "
                        f"('1:3'); got {text!r}")
    replica = int(match.group(1) or 0)
    slot = int(match.group(2))
    if replica >= dp:
      raise ConfigError(f"ntp.failed: replica {replica} in {item!r} does not exist "
                        f"(mesh.dp={dp})")
    if slot >= tp:
      raise ConfigError(f"ntp.failed: slot {slot} in {item!r} does not exist (mesh.tp={tp})")
    if slot in failed.get(replica, []):
      raise ConfigError(f"ntp.failed: replica {replica} slot {slot} is listed twice in {text!r}")
    failed.setdefault(replica, []).append(slot)
  return {r: tuple(sorted(s)) for r, s in sorted(failed.items())}


def parse_weights(text: str, tp: int) -> tuple[float, ...] | None:
  """``ntp.slot_weights`` -> one relative speed per slot, or None (equal).

  Raises:
    ConfigError: naming ``ntp.slot_weights``: not numbers, not ``mesh.tp`` of
      them, a negative or non-finite weight, or all zero.
  """
  text = str(text).strip()
  if not text:
    return None
  try:
    weights = tuple(float(w) for w in text.split(","))
  except ValueError:
    raise ConfigError(f"ntp.slot_weights: {text!r} is not a comma-separated list of "
                      "numbers") from None
  if len(weights) != tp:
    raise ConfigError(f"ntp.slot_weights: {len(weights)} weights given, mesh.tp={tp} slots "
                      "need one each")
  if not all(math.isfinite(w) for w in weights):
    raise ConfigError(f"ntp.slot_weights: weights must be finite, got {text!r}")
  if any(w < 0 for w in weights):
    raise ConfigError(f"ntp.slot_weights: weights must be >= 0, got {text!r}")
  if not any(w > 0 for w in weights):
    raise ConfigError(f"ntp.slot_weights: at least one weight must be positive, got {text!r}")
  return weights


def make_plan(make_layouts: Callable[[int, Sequence[int], Sequence[float] | None], Any], *,
              tp: int, dp: int, failed: str = "", slot_weights: str = "", batch_size: int,
              rebalance: str = "proportional") -> Plan:
  """Plan a job of ``dp`` replicas x ``tp`` slots after the given failures.

  Args:
    make_layouts: ``(tp, failed_slots, weights) -> layouts`` of the model for
      one TP group (e.g. ``functools.partial(models.gpt.model_layouts, cfg)``).
    tp, dp: ``mesh.tp``, ``mesh.dp``.
    failed: ``ntp.failed`` text (see ``parse_failed``).
    slot_weights: ``ntp.slot_weights`` text (see ``parse_weights``).
    batch_size: ``train.batch_size``, sequences per step of the healthy job.
    rebalance: ``ntp.rebalance``: ``proportional`` (share ~ degree / tp) or ``equal``.

  Every setting is checked here, so ``make_layouts`` (whose errors about its
  own arguments are ``ValueError``s, see ``ntp_jax.sharding.layout``) only sees valid
  slots and weights.

  Raises:
    ConfigError: one line naming the field: bad settings; every replica
      dropped; a replica whose live slots all have weight 0; a batch that
      does not split over the replicas.
  """
  if dp < 1:
    raise ConfigError(f"mesh.dp: must be >= 1, got {dp}")
  if tp < 1:
    raise ConfigError(f"mesh.tp: must be >= 1, got {tp}")
  if rebalance not in REBALANCE:
    raise ConfigError(f"ntp.rebalance: {rebalance!r} is not one of {', '.join(REBALANCE)}")
  if batch_size < 1:
    raise ConfigError(f"train.batch_size: must be >= 1, got {batch_size}")
  if batch_size % dp:
    raise ConfigError(f"train.batch_size: {batch_size} sequences do not split evenly over "
                      f"mesh.dp={dp} replicas")
  failed_by_replica = parse_failed(failed, dp, tp)
  weights = parse_weights(slot_weights, tp)
  healthy_share = batch_size // dp

  live_by_replica, dropped = {}, []
  for r in range(dp):
    if len(failed_by_replica.get(r, ())) == tp:
      dropped.append(r)
    else:
      live_by_replica[r] = live_slots_of(tp, failed_by_replica.get(r, ()))
  if not live_by_replica:
    raise ConfigError(f"ntp.failed: every slot of every replica failed ({failed!r}); "
                      "no replica is left to train")
  for r, slots in live_by_replica.items():
    if weights is not None and not any(weights[s] > 0 for s in slots):
      raise ConfigError(f"ntp.slot_weights: replica {r}'s live slots "
                        f"{','.join(map(str, slots))} all have weight 0 ({slot_weights!r})")

  # Shares follow the degree relative to the fastest live replica: t/T beside a
  # healthy replica; a lone (or all-reduced) job keeps its full batch.
  top_degree = max(len(slots) for slots in live_by_replica.values())

  def share(degree: int) -> int:
    if rebalance == "equal":
      return healthy_share
    return max(1, (healthy_share * degree + top_degree // 2) // top_degree)

  # Replicas whose layouts are equal (same unit split; live slot ids do not
  # count) share a class and so one compiled program. Highest degree first.
  by_layouts: dict[Any, list[int]] = {}
  for r, slots in sorted(live_by_replica.items(), key=lambda kv: (-len(kv[1]), kv[0])):
    failed_slots = tuple(s for s in range(tp) if s not in slots)
    by_layouts.setdefault(make_layouts(tp, failed_slots, weights), []).append(r)
  classes = []
  for index, (layouts, members) in enumerate(by_layouts.items()):
    slots = tuple(live_by_replica[r] for r in members)
    classes.append(ReplicaClass(index=index, live_slots=slots, replicas=tuple(members),
                                layouts=layouts, batch_share=share(len(slots[0]))))
  replicas = tuple(
      ReplicaPlan(replica=r, live_slots=slots, batch_share=c.batch_share, class_index=c.index)
      for c in classes for r, slots in zip(c.replicas, c.live_slots))
  return Plan(tp=tp, dp=dp, replicas=tuple(sorted(replicas, key=lambda r: r.replica)),
              dropped=tuple(dropped), classes=tuple(classes), rebalance=rebalance,
              logical_layouts=make_layouts(1, (), None))
