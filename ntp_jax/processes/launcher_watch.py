"""A process started by ``python -m ntp_jax.launch`` stops itself when its launcher dies.

The launcher starts each process in a session of its own (a Ctrl-C in the terminal
reaches the launcher only, which passes it on), so nothing else stops them when the
launcher is killed outright (``kill -9``, an out-of-memory kill). It names itself in
``NTP_JAX_LAUNCHER_PID``; ``watch_launcher`` starts a daemon thread that waits for that
process to end and then sends this process SIGTERM: the trainer takes it as a stop request
(``resilience.signals``), agreed with the other processes (``heartbeat.StopAgreement``), so
they stop at one step and write one checkpoint; before training has started, SIGTERM's
default ends the process.

Why a watching thread rather than ``prctl(PR_SET_PDEATHSIG)``: the latter must be set
between fork and exec (``preexec_fn``, unsafe while the launcher runs its output threads and
gRPC's), reaches only a direct child (not ``bash -c 'python train.py'``), and fires when the
launcher's *thread* that forked ends. A pidfd (Linux 5.3+) is woken when the process itself
ends and cannot be fooled by a reused pid; elsewhere the thread asks every second whether
the pid still exists. Either way the process's output, a pipe the dead launcher read, is
sent to ``/dev/null`` first: a write into a pipe with no reader raises ``BrokenPipeError``,
which would end the stop before its checkpoint.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

ENV_LAUNCHER_PID = "NTP_JAX_LAUNCHER_PID"  # set by ntp_jax.launch for each process it starts
POLL_S = 1.0  # where no pidfd exists: how often the launcher's pid is looked for
_watching: threading.Thread | None = None


def watch_launcher(environ: dict[str, str] | None = None) -> threading.Thread | None:
  """Start the watch on the launcher named by ``NTP_JAX_LAUNCHER_PID`` (once per process: a
  later call returns the same thread); None when the variable is unset or not a number.
  Raises nothing."""
  global _watching
  if _watching is not None:
    return _watching
  env = os.environ if environ is None else environ
  try:
    pid = int(env.get(ENV_LAUNCHER_PID, ""))
  except ValueError:
    return None
  thread = threading.Thread(target=_stop_when_ended, args=(pid,), daemon=True,
                            name="ntp_jax launcher watch")
  thread.start()
  _watching = thread
  return thread


def wait_until_ended(pid: int) -> None:
  """Return once process ``pid`` has ended (at once if it already has)."""
  try:
    fd = os.pidfd_open(pid)
  except ProcessLookupError:
    return
  except (AttributeError, OSError):  # no pidfd here: look for the pid every POLL_S
    while _exists(pid):
      time.sleep(POLL_S)
    return
  try:
    select.select([fd], [], [])  # readable once the process has ended
  finally:
    os.close(fd)


def _exists(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # the pid now names someone else's process
    return False
  return True


def _stop_when_ended(pid: int) -> None:
  wait_until_ended(pid)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  os.dup2(devnull, 2)
  os.close(devnull)
  os.kill(os.getpid(), signal.SIGTERM)
