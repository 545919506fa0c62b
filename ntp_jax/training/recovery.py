"""The record of one recovery, from the failure to the first step on the new plan.

A failure or repair (``loop.TrainingRun.apply``) opens a ``RecoveryRecord``;
the live path (state from DP peers) or the restart path (the last checkpoint)
fills in how it went; the first step on the new plan closes it, and
``Recoveries`` writes it as the ``recovered`` event of ``metrics.jsonl``
(``docs/recovery.md`` reads the fields).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class RecoveryRecord:
  """How one recovery went; times in seconds, sizes in bytes.

  Attributes:
    start: ``time.perf_counter()`` at the failure.
    compiled: this thread's compile seconds (``compilation.compile_seconds``) at the failure.
    plan_s: planning the new job. wait_s: waiting for a compile ahead of this plan.
    ahead: the new plan's programs were compiled ahead (``ntp.precompile``).
    cut: the failure came inside a step, which is redone.
    path: ``"live"`` (from DP peers), ``"restart"`` (from the last checkpoint) or
      ``"interrupted"`` (a peer lost during the move: the next recovery starts again from
      the old state); None until one is taken.
    seconds: from the failure to the state on the new plan. move_s: the move (or restore)
      and building the new plan's class programs. transfer_s: of that, the state's own move
      (live), until its arrays were ready.
    copied_bytes: bytes copied between devices (live). crossed_bytes: of those, between
      processes (several processes only). redo: steps redone (restart).
  """

  start: float
  compiled: float
  plan_s: float = 0.0
  wait_s: float = 0.0
  ahead: bool = False
  cut: bool = False
  path: str | None = None
  seconds: float | None = None
  move_s: float | None = None
  transfer_s: float | None = None
  copied_bytes: int | None = None
  crossed_bytes: int | None = None
  redo: int | None = None

  def event_fields(self, compile_s: float, first_step_s: float | None,
                   by_process: dict[int, float | None] | None = None) -> dict[str, Any]:
    """The ``recovered`` event's fields: those set, ``compile_s`` (this thread's compile
    seconds from the failure to the end of the first step; with ``by_process``, every
    process's, the most of them), ``compiled_ahead`` and ``first_step_s`` (None: no step ran
    on the new plan).

    Args:
      by_process: several processes: each live one's compile seconds over the same span
        (None: not heard from), written as ``compile_s_by_process`` (``[process, seconds]``
        pairs).
    """
    fields = {k: getattr(self, k) for k in ("path", "seconds", "plan_s", "wait_s", "move_s",
                                            "transfer_s", "copied_bytes", "crossed_bytes", "redo")
              if getattr(self, k) is not None}
    fields["compile_s"] = round(compile_s, 3)
    if by_process:
      fields["compile_s"] = round(max([compile_s] + [s for s in by_process.values()
                                                     if s is not None]), 3)
      fields["compile_s_by_process"] = [[p, None if s is None else round(s, 3)]
                                        for p, s in sorted(by_process.items())]
    fields["compiled_ahead"] = self.ahead
    if first_step_s is not None:
      fields["first_step_s"] = first_step_s
    return fields


class Recoveries:
  """The recovery in progress, until the first step on its plan writes it.

  Args:
    event: ``(kind, **fields) -> None`` (``metrics.MetricsWriter.event``).
    compile_seconds: ``() -> float``: this thread's compile seconds so far.
    gather: ``(step, seconds) -> {process: seconds} | None``: every process's compile
      seconds of the recovery whose first step is ``step`` (several processes:
      ``ProcessGuard.compile_seconds_of``); called in every process, after a step only.
  """

  def __init__(self, event: Callable[..., None], compile_seconds: Callable[[], float],
               gather: Callable[[int, float], dict[int, float | None] | None] | None = None):
    self._event, self._compile_seconds, self._gather = event, compile_seconds, gather
    self.pending: RecoveryRecord | None = None

  def begin(self, start: float, compiled: float, **fields: Any) -> RecoveryRecord:
    """Open the record of a new recovery (replacing any pending one: ``finish`` it first)."""
    self.pending = RecoveryRecord(start, compiled, **fields)
    return self.pending

  def finish(self, step: int, first_step_s: float | None) -> None:
    """Write the pending record as the ``recovered`` event of ``step`` (the first step on the
    new plan; ``first_step_s=None``: no step will run on it, ``step`` is the next one);
    nothing when none is pending."""
    if self.pending is None:
      return
    record, self.pending = self.pending, None
    compile_s = self._compile_seconds() - record.compiled
    by_process = None
    if self._gather is not None and first_step_s is not None:
      by_process = self._gather(step, compile_s)
    self._event("recovered", step=step, **record.event_fields(compile_s, first_step_s,
                                                              by_process))
