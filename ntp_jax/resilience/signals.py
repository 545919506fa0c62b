"""Stop requests from SIGTERM (preemption) and SIGINT (Ctrl-C), taken between steps.

The first signal only sets a flag: the trainer finishes the step in flight,
writes a checkpoint and exits cleanly, so ``metrics.jsonl`` and the
checkpoints are never left half written. A second SIGINT raises
``KeyboardInterrupt`` at once (for a user who does not want to wait for a
long compilation); the trainer then stops without saving the step in flight.
In a multi-process job the processes agree on the step to stop at
(``heartbeat.StopAgreement``), so their last collective steps and the
final checkpoint match. A process of such a job receives its signal at any moment,
start-up included: ``hold_stop_signals`` keeps one that arrives before the run
begins, and the run stops at its first agreed step instead of the process dying
alone (its peers would then meet a lost process).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

_held: list[str] = []  # stop signals received before a run began (hold_stop_signals)


def hold_stop_signals() -> None:
  """From now on, a SIGTERM or SIGINT that arrives before a run's ``StopSignals`` is kept
  for that run (which then stops at its first agreed step) instead of ending the process;
  a second SIGINT still raises ``KeyboardInterrupt``. Main thread only; raises nothing."""

  def hold(signum: int, frame: FrameType | None) -> None:
    if _held and signum == signal.SIGINT:
      raise KeyboardInterrupt
    _held.append(signal.Signals(signum).name)

  if threading.current_thread() is threading.main_thread():
    for sig in StopSignals.SIGNALS:
      signal.signal(sig, hold)


class StopSignals:
  """Context manager that records SIGTERM / SIGINT instead of dying on them.

  Outside the main thread (where Python cannot install handlers) it does
  nothing and the default behaviour stays.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, agreement=None):
    self.received: str | None = None
    self.agreement = agreement  # several processes: heartbeat.StopAgreement
    self._previous: dict[int, object] = {}

  def due(self, step: int) -> bool:
    """Stop before ``step``? In a multi-process job every process answers the same at
    the same step (``heartbeat.StopAgreement``), whichever got the signal."""
    if self.agreement is None:
      return self.received is not None
    name = self.agreement.due(step, self.received)
    if name is not None and self.received is None:
      self.received = f"{name} (another process)"
    return name is not None

  def _handle(self, signum: int, frame: FrameType | None) -> None:
    if self.received is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.received = signal.Signals(signum).name

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
      if _held and self.received is None:  # arrived while the run was being set up
        self.received = _held[0]
    return self

  def __exit__(self, *exc) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous.clear()
