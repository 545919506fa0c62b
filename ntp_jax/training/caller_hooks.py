"""The caller's hooks, guarded: an exception in one stops the run cleanly.

``train(config, hooks=[...])`` wraps each hook it is given (and a ``detector``) in a
``CallerHook``. An exception the hook raises comes out of the loop as a ``HookError``
naming the hook, the method and the step; the trainer then ends the run as it ends a
stopped one (the steps done saved when checkpoints are on, a ``stop`` row in
``metrics.jsonl``) and re-raises the hook's own exception. The exceptions the loop
itself acts on pass through unchanged: ``events.DeviceFailure`` (a device found dead)
and ``arrival.ProcessLost``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ntp_jax.processes.arrival import ProcessLost
from ntp_jax.resilience.events import DeviceFailure, Event
from ntp_jax.training.hooks import FunctionHook, Hook, RunServices, StepInfo

# What a hook may raise for the loop to act on, not to stop the run.
_PASSED_THROUGH = (DeviceFailure, ProcessLost)


class HookError(Exception):
  """A caller's hook raised.

  Attributes:
    where: ``"Class.method"`` of the hook that raised.
    step: the step it was called for (``before_step``: the step about to run;
      ``on_step``: the step just run; ``on_end``: the steps done).
    error: the hook's own exception.
  """

  def __init__(self, where: str, step: int, error: Exception):
    self.where, self.step, self.error = where, step, error
    super().__init__(f"hook {where} raised at step {step}: {type(error).__name__}: {error}")


class CallerHook(Hook):
  """``hook`` as it is, its exceptions (but ``DeviceFailure``, ``ProcessLost``) raised as
  ``HookError``."""

  def __init__(self, hook: Hook):
    self.hook = hook

  def _where(self, method: str) -> str:
    if isinstance(self.hook, FunctionHook):  # a plain function: its own name says more
      return getattr(self.hook.fn, "__qualname__", repr(self.hook.fn))
    return f"{type(self.hook).__qualname__}.{method}"

  def _call(self, method: str, step: int, *args):
    try:
      return getattr(self.hook, method)(*args)
    except _PASSED_THROUGH:
      raise
    except Exception as err:
      raise HookError(self._where(method), step, err) from err

  def due(self, info: StepInfo) -> bool:
    return self._call("due", info.step, info)

  def before_step(self, step: int, services: RunServices) -> Sequence[Event]:
    return list(self._call("before_step", step, step, services))

  def on_step(self, info: StepInfo) -> None:
    self._call("on_step", info.step, info)

  def on_end(self, services: RunServices) -> None:
    self._call("on_end", services.done, services)
