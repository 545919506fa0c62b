"""``python -m ntp_jax.launch`` passes SIGTERM and Ctrl-C on to every process and takes their
status, and a process whose launcher was killed stops itself (``processes.launcher_watch``).

The processes here are small Python programs (no JAX) that stop as the trainer does on a
signal; ``tests/system/test_multiprocess.py`` does the same with ``train.py``. Every process
runs under a timeout and is killed by its id at the end.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, process_env

# Writes its pid, then waits; on SIGTERM or SIGINT it takes half a second (a checkpoint's
# write), prints, notes the signal in a file and exits 0. It watches its launcher as train.py
# does (distributed.join).
_STOPS_ON_A_SIGNAL = """
import os, signal, sys, time
from ntp_jax.processes.launcher_watch import watch_launcher
i, folder = os.environ['NTP_JAX_PROCESS_ID'], sys.argv[1]
def stop(signum, frame):
    time.sleep(0.5)
    print(f'process {i} stops on {signal.Signals(signum).name}', flush=True)
    open(os.path.join(folder, f'stopped{i}'), 'w').write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
watch_launcher()
open(os.path.join(folder, f'pid{i}'), 'w').write(str(os.getpid()))
time.sleep(60)
sys.exit(5)
"""


def _alive(pid: int) -> bool:
  """Running (a zombie no one has reaped yet counts as ended)."""
  try:
    with open(f"/proc/{pid}/stat") as stat:
      return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def _start_job(folder, processes=2):
  launcher = subprocess.Popen(
      [sys.executable, "-m", "ntp_jax.launch", f"--processes={processes}", "--",
       sys.executable, "-c", _STOPS_ON_A_SIGNAL, str(folder)],
      cwd=ROOT, env=process_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True, start_new_session=True)
  deadline = time.monotonic() + 60
  while not all((folder / f"pid{i}").exists() for i in range(processes)):
    assert launcher.poll() is None, launcher.stdout.read()
    assert time.monotonic() < deadline, "the processes did not start in 60 s"
    time.sleep(0.05)
  pids = [int((folder / f"pid{i}").read_text()) for i in range(processes)]
  return launcher, pids


def _kill_all(launcher, pids):
  for pid in pids:
    if _alive(pid):
      os.kill(pid, signal.SIGKILL)
  if launcher.poll() is None:
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_reaches_every_process_and_a_clean_stop_is_status_0(
    tmp_path, sig):
  launcher, pids = _start_job(tmp_path)
  try:
    launcher.send_signal(sig)
    status = launcher.wait(timeout=30)
    output = launcher.stdout.read()
  finally:
    _kill_all(launcher, pids)
  assert status == 0, output
  for i in range(2):
    assert (tmp_path / f"stopped{i}").read_text() == sig.name  # one signal each, not two
    assert f"[{i}] process {i} stops on {sig.name}" in output
  assert f"[launch] {sig.name}: passed on to processes [0, 1]" in output
  assert not any(_alive(pid) for pid in pids)


def test_a_process_whose_launcher_was_killed_stops_itself(tmp_path):
  """SIGKILL to the launcher: each process gets SIGTERM from its watch, and its print, into
  the pipe the launcher no longer reads, goes nowhere instead of raising."""
  launcher, pids = _start_job(tmp_path)
  try:
    os.killpg(launcher.pid, signal.SIGKILL)  # the launcher alone: its processes have sessions
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
      time.sleep(0.05)
    alive = [pid for pid in pids if _alive(pid)]
  finally:
    _kill_all(launcher, pids)
  assert alive == []
  for i in range(2):  # written after the print: the print raised nothing
    assert (tmp_path / f"stopped{i}").read_text() == "SIGTERM"


def test_a_stop_signal_during_start_up_is_held_for_the_run():
  """A process of a multi-process job that gets SIGTERM before its run begins keeps it for
  the run (``hold_stop_signals``), which stops at its first agreed step."""
  program = ("import os, signal\n"
             "from ntp_jax.resilience.signals import StopSignals, hold_stop_signals\n"
             "hold_stop_signals()\n"
             "os.kill(os.getpid(), signal.SIGTERM)\n"
             "with StopSignals() as stop:\n"
             "    print(stop.received, stop.due(0))\n")
  done = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=process_env(),
                        capture_output=True, text=True, timeout=60)
  assert (done.returncode, done.stdout) == (0, "SIGTERM True\n"), done.stderr
