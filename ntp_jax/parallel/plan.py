"""The job's placement: replicas, their live slots and classes, and batch shares.

A job has ``dp`` DP replicas of ``tp`` slots each. After failures a replica
keeps its live slots and trains at TP degree ``t = live slots`` (NTP); a
replica with no live slot is dropped. Replicas whose layouts split the
model the same way (same degree and speed weights, whichever slots failed)
and whose batch shares are equal form a *replica class*, which runs one
compiled program over its own sub-mesh. Batch shares keep every live device equally
busy: ``proportional`` gives a replica at degree ``t`` about ``t/T`` of a
healthy replica's sequences (``t / t_max`` of the fastest replica's share when
no replica is healthy, so a lone reduced replica keeps the full batch), and
the global batch shrinks with the live devices; ``constant`` spreads the
healthy job's whole batch over the live replicas in proportion to their
degree, so failures leave the sequences of every step unchanged; ``equal``
gives every live replica the healthy share. A share runs as micro-batches
no larger than the healthy job's (``train.microbatches``), their gradients
summed. Source: Arfeen et al., arXiv:2504.06095, Sec. 4.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

from ntp_jax.errors import ConfigError
from ntp_jax.sharding.layout import live_slots as live_slots_of

REBALANCE = ("proportional", "equal", "constant")  # batch-share policies


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
  """Replicas sharing one layout and one batch share: one compiled program over a
  ``(replicas, degree)`` mesh.

  The replicas may have lost different slots: a layout is a unit split over
  the live slots in order, whichever slots those are.
  """

  index: int
  live_slots: tuple[tuple[int, ...], ...]  # per replica, in ``replicas`` order
  replicas: tuple[int, ...]
  layouts: Any  # the model's layouts for these live slots (e.g. models.gpt.ModelLayouts)
  batch_share: int  # sequences per replica per step
  microbatches: int = 1  # micro-batches each replica's share runs as (gradients summed)

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
                          "batch_share": r.batch_share,
                          "microbatches": self.classes[r.class_index].microbatches}
                         for r in self.replicas],
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
                   f"batch share {r.batch_share}"
                   + micro_batch_text(r.batch_share, self.classes[r.class_index].microbatches))
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


def make_plan(make_layouts: Callable[[int, Sequence[int], Sequence[float] | None], Any], *,
              tp: int, dp: int, failed: Collection[tuple[int, int]] = (),
              slot_weights: Sequence[float] | None = None, batch_size: int,
              rebalance: str = "proportional", microbatches: int = 1) -> Plan:
  """Plan a job of ``dp`` replicas x ``tp`` slots after the given failures.

  Args:
    make_layouts: ``(tp, failed_slots, weights) -> layouts`` of the model for
      one TP group (e.g. ``functools.partial(models.gpt.model_layouts, cfg)``).
    tp, dp: ``mesh.tp``, ``mesh.dp``.
    failed: the failed ``(replica, slot)`` pairs (``ntp.failed`` parsed by
      ``training.config.parse_failed``, plus the events so far).
    slot_weights: one relative speed per slot (``ntp.slot_weights``), or None: equal.
    batch_size: ``train.batch_size``, sequences per step of the healthy job.
    rebalance: ``ntp.rebalance``: ``proportional`` (share ~ degree / tp),
      ``equal``, or ``constant`` (``batch_size`` over the live replicas ~ degree).
    microbatches: ``train.microbatches``: micro-batches of a healthy replica's
      share. Every class runs as many micro-batches as keep its own no larger
      than the healthy one (``ceil(share / healthy micro-batch)``).

  The settings themselves are checked once, in ``training.config``; this checks
  what depends on the failure state, which changes while a job runs.

  Raises:
    ConfigError: every replica dropped; a replica whose live slots all have
      weight 0 (one line naming the field).
    ValueError: arguments that ``training.config`` would have refused (naming
      the argument): a size below 1, a batch that does not split over the
      replicas, a pair outside the mesh, weights not one per slot.
  """
  if dp < 1 or tp < 1 or batch_size < 1:
    raise ValueError(f"make_plan: tp, dp and batch_size must be >= 1, got {tp}, {dp}, "
                     f"{batch_size}")
  if rebalance not in REBALANCE:
    raise ValueError(f"make_plan: rebalance {rebalance!r} is not one of {', '.join(REBALANCE)}")
  if batch_size % dp:
    raise ValueError(f"make_plan: batch_size {batch_size} does not split over {dp} replicas")
  if microbatches < 1 or (batch_size // dp) % microbatches:
    raise ValueError(f"make_plan: a replica's {batch_size // dp} sequences do not split into "
                     f"{microbatches} micro-batches")
  if any(not (0 <= r < dp and 0 <= s < tp) for r, s in failed):
    raise ValueError(f"make_plan: failed {sorted(failed)} holds a pair outside {dp} x {tp}")
  if slot_weights is not None and len(slot_weights) != tp:
    raise ValueError(f"make_plan: {len(slot_weights)} slot weights for {tp} slots")
  weights = None if slot_weights is None else tuple(slot_weights)
  failed_by_replica: dict[int, tuple[int, ...]] = {}
  for r, s in sorted(failed):
    failed_by_replica[r] = failed_by_replica.get(r, ()) + (s,)
  healthy_share = batch_size // dp

  live_by_replica, dropped = {}, []
  for r in range(dp):
    if len(failed_by_replica.get(r, ())) == tp:
      dropped.append(r)
    else:
      live_by_replica[r] = live_slots_of(tp, failed_by_replica.get(r, ()))
  if not live_by_replica:
    raise ConfigError(f"ntp.failed: every slot of every replica failed "
                      f"({format_failed(failed)!r}); no replica is left to train")
  for r, slots in live_by_replica.items():
    if weights is not None and not any(weights[s] > 0 for s in slots):
      raise ConfigError(f"ntp.slot_weights: replica {r}'s live slots "
                        f"{','.join(map(str, slots))} all have weight 0 "
                        f"({','.join(f'{w:g}' for w in weights)})")

  # Shares follow the degree relative to the fastest live replica: t/T beside a
  # healthy replica; a lone (or all-reduced) job keeps its full batch.
  top_degree = max(len(slots) for slots in live_by_replica.values())

  def share(degree: int) -> int:
    if rebalance == "equal":
      return healthy_share
    return max(1, (healthy_share * degree + top_degree // 2) // top_degree)

  if rebalance == "constant":
    shares = constant_shares(batch_size, {r: len(s) for r, s in live_by_replica.items()})
  else:
    shares = {r: share(len(s)) for r, s in live_by_replica.items()}
  micro_rows = healthy_share // microbatches  # a healthy replica's micro-batch

  # Replicas whose layouts and shares are equal (same unit split; live slot ids do
  # not count) share a class and so one compiled program. Highest degree first.
  by_layouts: dict[Any, list[int]] = {}
  for r, slots in sorted(live_by_replica.items(), key=lambda kv: (-len(kv[1]), kv[0])):
    failed_slots = tuple(s for s in range(tp) if s not in slots)
    by_layouts.setdefault((make_layouts(tp, failed_slots, weights), shares[r]), []).append(r)
  classes = []
  for index, ((layouts, rows), members) in enumerate(by_layouts.items()):
    slots = tuple(live_by_replica[r] for r in members)
    classes.append(ReplicaClass(index=index, live_slots=slots, replicas=tuple(members),
                                layouts=layouts, batch_share=rows,
                                microbatches=-(-rows // micro_rows)))
  replicas = tuple(
      ReplicaPlan(replica=r, live_slots=slots, batch_share=c.batch_share, class_index=c.index)
      for c in classes for r, slots in zip(c.replicas, c.live_slots))
  return Plan(tp=tp, dp=dp, replicas=tuple(sorted(replicas, key=lambda r: r.replica)),
              dropped=tuple(dropped), classes=tuple(classes), rebalance=rebalance,
              logical_layouts=make_layouts(1, (), None))


def constant_shares(batch_size: int, degrees: dict[int, int]) -> dict[int, int]:
  """``batch_size`` sequences over replicas in proportion to their degree, at least one each.

  Largest remainders (ties to the lower replica index), so the shares sum to
  ``batch_size`` exactly: a failure or a dropped replica leaves the step's
  sequences unchanged.
  """
  total = sum(degrees.values())
  shares = {r: batch_size * d // total for r, d in degrees.items()}
  by_remainder = sorted(degrees, key=lambda r: (-(batch_size * degrees[r] % total), r))
  for r in by_remainder[:batch_size - sum(shares.values())]:
    shares[r] += 1
  for r in sorted(shares, key=lambda r: shares[r]):  # no replica without a sequence
    if shares[r] == 0:
      donor = max(shares, key=lambda q: (shares[q], -q))
      shares[donor] -= 1
      shares[r] = 1
  return shares


def micro_batch_text(share: int, microbatches: int) -> str:
  """``" (2 micro-batches of 5, 4 rows)"``; empty for one."""
  if microbatches == 1:
    return ""
  q, r = divmod(share, microbatches)
  sizes = f"{q + 1} and {q} rows" if r else f"{q} row{'s' if q > 1 else ''}"
  return f" ({microbatches} micro-batches of {sizes})"


def format_failed(failed: Collection[tuple[int, int]]) -> str:
  """``{(1, 2), (0, 3)}`` -> ``"0:3,1:2"`` (``ntp.failed`` syntax)."""
  return ",".join(f"{r}:{s}" for r, s in sorted(failed))


def reachable_failed_sets(failed: Collection[tuple[int, int]], *, dp: int, tp: int
                          ) -> list[frozenset[tuple[int, int]]]:
  """The failed sets one more failure or one repair leads to from ``failed``.

  One more failed device of any replica (``dp * tp - len(failed)`` sets, by
  replica and slot), then each failed device repaired. Sets whose plan
  cannot run (no live replica) are the planner's to refuse.
  """
  failed = frozenset(failed)
  more = [failed | {(r, s)} for r in range(dp) for s in range(tp) if (r, s) not in failed]
  return more + [failed - {pair} for pair in sorted(failed)]
