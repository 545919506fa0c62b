"""Failures and repairs as events: what changes the set of failed ``(replica, slot)`` pairs.

``ntp.fail_at`` / ``ntp.repair_at`` (and a failure detector) give ``Event``s;
the loop applies them before their step (or inside it, ``mid``) and re-plans.
Source: Arfeen et al., arXiv:2504.06095, Sec. 3-4 (reduced TP degree after a
failure).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from ntp_jax.errors import ConfigError

KINDS = ("fail", "repair")


@dataclasses.dataclass(frozen=True, order=True)
class Event:
  """A device failing or coming back before step ``step`` (or inside it, ``mid``).

  ``mid``: the failure strikes after that step's gradients are computed and
  before they are applied; the step's work is discarded and redone.
  """

  step: int
  mid: bool
  kind: str
  replica: int
  slot: int

  def describe(self) -> str:
    where = f"{self.step}.mid" if self.mid else str(self.step)
    return f"{self.kind} {where}@{self.replica}:{self.slot}"


class DeviceFailure(Exception):
  """Raised by a failure detector (or a step) when ``(replica, slot)``'s device is lost.

  The trainer catches it around a step and recovers as for a ``mid`` event.
  """

  def __init__(self, replica: int, slot: int):
    super().__init__(f"device of replica {replica} slot {slot} failed")
    self.replica, self.slot = replica, slot


def parse_events(text: str, kind: str, *, dp: int, tp: int, steps: int) -> list[Event]:
  """``ntp.fail_at`` / ``ntp.repair_at`` text -> events.

  Syntax: ``STEP@REPLICA:SLOT`` items separated by commas; ``STEP.mid@...``
  (failures only) strikes inside the step. Example: ``"20@0:3,25.mid@1:0"``.

  Raises:
    ConfigError: naming the field, for a malformed item, a replica or slot
      that does not exist, or a step outside ``[0, train.steps)``.
  """
  field = "ntp.fail_at" if kind == "fail" else "ntp.repair_at"
  events = []
  for item in filter(None, (i.strip() for i in str(text).split(","))):
    match = re.fullmatch(r"(\d+)(\.mid)?@(\d+):(\d+)", item)
    if not match:
      raise ConfigError(f"{field}: {item!r} is not STEP@REPLICA:SLOT (e.g. '20@0:3'"
                        f"{', or 20.mid@0:3' if kind == 'fail' else ''})")
    step, mid, replica, slot = int(match[1]), bool(match[2]), int(match[3]), int(match[4])
    if mid and kind == "repair":
      raise ConfigError(f"{field}: {item!r}: a repair happens between steps, not '.mid'")
    if replica >= dp:
      raise ConfigError(f"{field}: replica {replica} in {item!r} does not exist (mesh.dp={dp})")
    if slot >= tp:
      raise ConfigError(f"{field}: slot {slot} in {item!r} does not exist (mesh.tp={tp})")
    if step >= steps:
      raise ConfigError(f"{field}: step {step} in {item!r} is past train.steps={steps}")
    events.append(Event(step, mid, kind, replica, slot))
  return events


def check_events(events: Iterable[Event], failed: set[tuple[int, int]], tp: int, dp: int) -> None:
  """Replay the events over the launch failures: each must change the set.

  Raises:
    ConfigError: naming ``ntp.fail_at`` for a slot already dead, or
      ``ntp.repair_at`` for a slot that is live; or every slot of the job
      failed.
  """
  failed = set(failed)
  for event in sorted(events):
    pair = (event.replica, event.slot)
    if event.kind == "fail":
      if pair in failed:
        raise ConfigError(f"ntp.fail_at: {event.describe()}: replica {event.replica} slot "
                          f"{event.slot} is already failed at step {event.step}")
      failed.add(pair)
      if len(failed) == tp * dp:
        raise ConfigError(f"ntp.fail_at: {event.describe()} fails the last live slot of the job")
    else:
      if pair not in failed:
        raise ConfigError(f"ntp.repair_at: {event.describe()}: replica {event.replica} slot "
                          f"{event.slot} is live at step {event.step}; only a failed slot "
                          "can be repaired")
      failed.discard(pair)
