"""The job's step on a plan, its way of stepping chosen once, when the plan is built."""

from __future__ import annotations

from collections.abc import Callable

from ntp_jax.parallel.job_step import (
  Commit,
  CommittedJobStep,
  FusedJobStep,
  JobStep,
  SyncedJobStep,
)
from ntp_jax.parallel.plan import Plan
from ntp_jax.parallel.programs import ClassProgram, ProgramCache
from ntp_jax.parallel.sharded_step import ShardedJobStep
from ntp_jax.parallel.zero import ZeroSettings


def make_job_step(plan: Plan, programs: list[ClassProgram], cache: ProgramCache | None = None,
                  *, split: bool = False, before_sync: Callable[[], None] | None = None,
                  zero: ZeroSettings | None = None, commit: Commit | None = None) -> JobStep:
  """The step of the whole job over its class programs.

  Args:
    plan, programs: the plan and its class programs (``programs.build_class_programs``).
    cache: where the programs the step runs are kept (the run's ``ProgramCache``;
      default: a fresh one).
    split: the programs were built split (``build_class_programs(split=True)``): the
      gradient sync runs as its own program even with one class.
    before_sync: the arrival check before the sync (``SyncedJobStep``).
    zero: shard the optimizer state over the peer groups (``sharded_step.ShardedJobStep``;
      the programs built split).
    commit: steps that commit (``CommittedJobStep``; the programs built split).

  Returns:
    ``ShardedJobStep`` with ``zero``; else ``CommittedJobStep`` with ``commit``; else
    ``SyncedJobStep`` with several classes or ``split``; else ``FusedJobStep``.

  Raises:
    ValueError: ``commit`` without ``split``; this process holds no device of the plan.
  """
  if commit is not None and not split:
    raise ValueError("steps that commit need the split programs")
  if zero is not None:
    return ShardedJobStep(plan, programs, cache, before_sync=before_sync, zero=zero,
                          commit=commit)
  if commit is not None:
    return CommittedJobStep(plan, programs, cache, commit=commit)
  if len(programs) > 1 or split:
    return SyncedJobStep(plan, programs, cache, before_sync=before_sync)
  return FusedJobStep(plan, programs, cache)
