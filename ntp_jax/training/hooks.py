"""Step hooks: what runs around each training step, the trainer's defaults included.

The loop (``training.loop.TrainingRun``) runs a step and hands a ``StepInfo``
to each hook in order; a hook acts when it is ``due`` (by default every
``every`` steps done). Before a step, ``before_step`` lets a hook report
failures (``resilience.events.Event``s, or raise ``events.DeviceFailure``).
At the end of the run ``on_end`` runs once.

A hook sees the step's facts and ``RunServices``: what it may ask of the run
(save a checkpoint, evaluate rows, time work into a goodput bucket, read the
goodput, wait for the background compile). It never gets the trainer itself,
so the trainer's parts can change without breaking a hook.

The trainer's own work comes as default hooks, in this order: checkpoint,
validation, goodput, metrics file, TensorBoard, progress line; a failure
detector, when given, is a hook too. A hook may add fields to
``info.record`` (the step's metrics record, written by ``MetricsHook``), so
hooks that add fields come before the ones that write them. Hooks a user
passes (``train(config, hooks=[...])``) run after the defaults and see the
complete record. Pattern as in levanter's ``TrainerHooks``; code our own.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ntp_jax.parallel.plan import Plan
from ntp_jax.resilience.events import Event
from ntp_jax.resilience.goodput import GoodputClock
from ntp_jax.training.metrics import MetricsWriter, TensorBoardWriter, progress_line


class RunServices:
  """What a hook may ask of the run, and nothing more.

  Args:
    clock: the run's ``resilience.goodput.GoodputClock``.
    save: ``() -> float``: write a checkpoint of the steps done (``checkpoint.every > 0``);
      returns the seconds the step was held for it.
    evaluate: ``rows -> float``: the job's mean next-token loss (nats per token) of int32
      ``[n, seq_len + 1]`` rows, on the current plan.
    wait_for_compile_ahead: ``timeout_s | None -> bool``: wait for the background compile
      of the plans one failure away (``ntp.precompile``); True when none is running.
    plan: ``() -> Plan``: the current plan. done: ``() -> int``: steps done.
  """

  def __init__(self, *, clock: GoodputClock, save: Callable[[], float],
               evaluate: Callable[[np.ndarray], float],
               wait_for_compile_ahead: Callable[[float | None], bool],
               plan: Callable[[], Plan], done: Callable[[], int]):
    self._clock, self._save, self._evaluate = clock, save, evaluate
    self._wait, self._plan, self._done = wait_for_compile_ahead, plan, done

  @property
  def plan(self) -> Plan:
    """The plan the next step runs on."""
    return self._plan()

  @property
  def done(self) -> int:
    """Steps done so far (the next step's index)."""
    return self._done()

  def save(self) -> float:
    """A checkpoint of the steps done; returns the seconds the step was held for it.

    Raises:
      checkpoint.CheckpointError: the write failed (naming the folder).
    """
    return self._save()

  def evaluate(self, rows: np.ndarray) -> float:
    """Mean next-token loss (nats per token) of int32 ``[n, seq_len + 1]`` ``rows``."""
    return self._evaluate(rows)

  def timed(self, bucket: str) -> AbstractContextManager:
    """Time a block into the goodput bucket ``bucket`` (``resilience.goodput.BUCKETS``)."""
    return self._clock.timed(bucket)

  def goodput(self) -> float:
    """Productive seconds over wall seconds so far (``resilience.goodput``)."""
    return self._clock.goodput()

  def effective_tokens_per_s(self) -> float:
    """Tokens of productive steps over wall seconds so far."""
    return self._clock.effective_tokens_per_s()

  def wait_for_compile_ahead(self, timeout_s: float | None = None) -> bool:
    """Wait up to ``timeout_s`` (None: no bound) for the background compile of the plans one
    failure or repair away; True when none is running (also when it is off). In a job of
    several processes a peer lost meanwhile is taken over after the wait, as after a
    compile (the heartbeat allows 15 minutes for it)."""
    return self._wait(timeout_s)


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """One finished optimizer step, as hooks see it.

  Attributes:
    step: index of the step just run (0-based; ``record["step"]``).
    done: steps done after it (``step + 1``): a checkpoint of ``done`` resumes after it.
    total: ``train.steps``.
    plan: the plan the step ran on.
    loss: the job's mean next-token loss of the step (float32, nats per token).
    grad_norm: the global gradient norm before clipping.
    tokens: predicted tokens in the step (global batch x ``train.seq_len``).
    step_time_s: wall seconds of the step (compilation included when ``compiled``).
    compiled: the step compiled its programs (the first step of a plan not seen before).
    record: the metrics record of the step; hooks may add fields to it.
    services: what the hook may ask of the run (``RunServices``).
  """

  step: int
  done: int
  total: int
  plan: Plan
  loss: float
  grad_norm: float
  tokens: int
  step_time_s: float
  compiled: bool
  record: dict[str, Any]
  services: RunServices = dataclasses.field(repr=False)

  @property
  def last(self) -> bool:
    return self.done == self.total


# The methods the loop calls, and when: a subclass may define only these in public.
HOOK_METHODS = {
  "before_step": "before a step",
  "on_step": "after a step",
  "on_end": "once at the end",
  "due": "whether on_step runs",
}


def _is_method(value: Any) -> bool:
  return inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))


class Hook:
  """A hook on step events; subclass and override what you need.

  A subclass defines only the methods below in public (helpers of its own start with
  ``_``): a misspelt one (``after_step``) would never be called, so the class statement
  raises instead.

  Attributes:
    every: ``on_step`` runs after every ``every``-th step done (``done %
      every == 0``); 0 never (``due`` may say otherwise).

  Raises:
    TypeError: at the class statement of a subclass with a public method the loop does not
      call (naming the class, the method and the known ones).
  """

  every: int = 1

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    for name, value in vars(cls).items():
      if not name.startswith("_") and _is_method(value) and name not in HOOK_METHODS:
        known = ", ".join(f"{method} ({when})" for method, when in HOOK_METHODS.items())
        raise TypeError(f"hook {cls.__qualname__}.{name}: a Hook has no method {name!r}, so "
                        f"it would never be called; the methods are {known}; name a helper "
                        f"of your own _{name}")

  def due(self, info: StepInfo) -> bool:
    return self.every > 0 and info.done % self.every == 0

  def before_step(self, step: int, services: RunServices) -> Sequence[Event]:
    """Failures or repairs to apply before step ``step`` (default: none).

    May raise ``events.DeviceFailure`` for a device found dead.
    """
    return ()

  def on_step(self, info: StepInfo) -> None:
    """Called after a step when ``due(info)``."""

  def on_end(self, services: RunServices) -> None:
    """Called once when the run's loop ends (the last step, a stop, or an error)."""


class FunctionHook(Hook):
  """``fn(info)`` every ``every`` steps: a plain function as a hook."""

  def __init__(self, fn: Callable[[StepInfo], Any], every: int = 1):
    self.fn, self.every = fn, every

  def on_step(self, info: StepInfo) -> None:
    self.fn(info)


def as_hook(hook: Hook | Callable[[StepInfo], Any]) -> Hook:
  """A ``Hook`` as it is; a callable as ``FunctionHook(fn)`` (every step).

  Raises:
    TypeError: neither a ``Hook`` nor callable.
  """
  if isinstance(hook, Hook):
    return hook
  if callable(hook):
    return FunctionHook(hook)
  raise TypeError(f"hooks: {hook!r} is neither a training.hooks.Hook nor a function of StepInfo")


# -- the trainer's defaults ---------------------------------------------------------------------


class CheckpointHook(Hook):
  """Saves the state every ``checkpoint.every`` steps; adds ``checkpoint_s`` (the save's hold)."""

  def __init__(self, every: int):
    self.every = every

  def on_step(self, info: StepInfo) -> None:
    info.record["checkpoint_s"] = info.services.save()


class EvalHook(Hook):
  """Mean loss of fixed held-out ``rows`` every ``train.eval_every`` steps and after the
  last; adds ``val_loss``. The time counts in the goodput bucket ``eval``.

  Args:
    rows: int32 ``[n, seq_len + 1]`` held-out sequences (the same set every time).
  """

  def __init__(self, rows: np.ndarray, every: int):
    self.rows, self.every = rows, every

  def due(self, info: StepInfo) -> bool:
    return self.every > 0 and (info.done % self.every == 0 or info.last)

  def on_step(self, info: StepInfo) -> None:
    with info.services.timed("eval"):
      info.record["val_loss"] = info.services.evaluate(self.rows)


class GoodputHook(Hook):
  """Adds ``goodput`` and ``effective_tokens_per_s`` (``resilience.goodput``) to each record."""

  def on_step(self, info: StepInfo) -> None:
    info.record["goodput"] = info.services.goodput()
    info.record["effective_tokens_per_s"] = info.services.effective_tokens_per_s()


class MetricsHook(Hook):
  """Appends each step's record to ``metrics.jsonl`` (``metrics.MetricsWriter``)."""

  def __init__(self, writer: MetricsWriter):
    self.writer = writer

  def on_step(self, info: StepInfo) -> None:
    self.writer.write(info.record)


class TensorBoardHook(Hook):
  """Each record's scalars as TensorBoard events (``train.tensorboard``)."""

  def __init__(self, board: TensorBoardWriter):
    self.board = board

  def on_step(self, info: StepInfo) -> None:
    self.board.write(info.record)

  def on_end(self, services: RunServices) -> None:
    self.board.close()


class ProgressHook(Hook):
  """A progress line every ``train.log_every`` steps (by step index: the first step, with
  its compilation, is shown), after the last, and with every validation loss."""

  def __init__(self, log: Callable[[str], None], every: int):
    self.log, self.every = log, every

  def due(self, info: StepInfo) -> bool:
    return info.step % self.every == 0 or info.last or "val_loss" in info.record

  def on_step(self, info: StepInfo) -> None:
    self.log(progress_line(info.record, info.total))


class DetectorHook(Hook):
  """A failure detector: ``detector(step) -> [Event]`` before each step.

  ``detector`` may raise ``events.DeviceFailure`` for a device found dead
  (the loop treats it as a failure between steps).
  """

  every = 0

  def __init__(self, detector: Callable[[int], Sequence[Event]]):
    self.detector = detector

  def before_step(self, step: int, services: RunServices) -> Sequence[Event]:
    return list(self.detector(step))
