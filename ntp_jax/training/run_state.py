"""Where a run is between steps: its plan and programs, the step, the data cursor."""

from __future__ import annotations

import dataclasses
from typing import Any

from ntp_jax.parallel.plan import Plan
from ntp_jax.training.just_in_time import JustInTimeState


@dataclasses.dataclass
class RunState:
  """The training state of one run, as the loop changes it.

  Attributes:
    failed: the failed ``(replica, slot)`` pairs.
    plan: the current plan (None before the start).
    programs: its class programs (``parallel.programs.ClassProgram``), holding the state.
    job_step: the ``parallel.job_step.JobStep`` over them.
    step: steps done (the next step's index).
    cursor: sequences of the data walk consumed.
    furthest: the most steps done so far: a step below it is redone work.
    saved_step: the step of the last checkpoint written or restored; None: none.
    compile_next: the next step compiles its programs.
  """

  failed: frozenset[tuple[int, int]]
  plan: Plan | None = None
  programs: list = dataclasses.field(default_factory=list)
  job_step: Any = None
  step: int = 0
  cursor: int = 0
  furthest: int = 0
  saved_step: int | None = None
  compile_next: bool = True

  def start_at(self, step: int, cursor: int) -> None:
    """The run starts (or resumes) at ``step`` with the data ``cursor``."""
    self.step, self.cursor, self.furthest = step, cursor, step

  def rewind(self, step: int, cursor: int) -> None:
    """Back to a checkpoint's ``step`` and ``cursor``; the steps past it are redone."""
    self.step, self.cursor = step, cursor

  @property
  def redoing(self) -> bool:
    """The next step was done before (after a restart from an earlier checkpoint)."""
    return self.step < self.furthest

  def advance(self, rows: int) -> None:
    """A step of ``rows`` sequences is done."""
    self.cursor += rows
    self.step += 1
    self.furthest = max(self.furthest, self.step)

  def just_in_time(self, config_json: dict) -> JustInTimeState:
    """What a just-in-time checkpoint of the last completed step writes."""
    return JustInTimeState(self.programs, self.plan, self.step, self.cursor, config_json)
