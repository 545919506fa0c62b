"""Start a multi-process job on this machine: ``python -m ntp_jax.launch --processes N -- CMD``.

For trying multi-process runs without a cluster. Starts ``N`` copies of
``CMD`` (e.g. ``python train.py --config configs/gpt_tiny.py``), each told
its place through ``NTP_JAX_COORDINATOR`` (127.0.0.1 and a free port),
``NTP_JAX_NUM_PROCESSES`` and ``NTP_JAX_PROCESS_ID`` (read by
``ntp_jax.processes.distributed``), with its own CPU devices and gloo collectives.
Every output line is prefixed with ``[i]``; gloo's connection chatter is
dropped (``is_chatter``), and an ``error:`` line that several processes print alike
is printed once (``ErrorLines``). When one process fails, the others are stopped
(SIGTERM, then SIGKILL after ``--grace`` seconds) and the launcher exits
with the first failure's status.

Before starting anything, a ``train.py`` command's config is read and the job's
layout checked (``processes.job_layout``): a mistake is one line and status 2.
SIGTERM and SIGINT (Ctrl-C) are passed on to every process, which stop together
after the step in flight and write one checkpoint; the launcher's status is then
theirs (0 when each stopped cleanly). Each process watches the launcher
(``processes.launcher_watch``) and stops itself when the launcher is killed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from ntp_jax.processes.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
from ntp_jax.processes.launcher_watch import ENV_LAUNCHER_PID
from ntp_jax.processes.service import ENV_EXTERNAL_SERVICE, serve


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# gloo's connection chatter, one line per process and collective group (dropped from the output):
# "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
GLOO_CHATTER = re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                          r"Expected number of connected peer ranks is : \d+\s*")
# gloo writes that line in pieces, and several threads write at once: the pieces of two
# lines interleave ("[Gloo] Rank 1 is connected to [Gloo] Rank 3 is connected to 3 peer
# ranks. ..."), and a number can land on a line of its own.
GLOO_PIECE = re.compile(r"\[Gloo\] Rank (\d+)?| is connected to (\d+)?|(\d+ )? ?peer ranks\. ?"
                        r"|Expected number of connected peer ranks is : (\d+)?")


def is_chatter(line: str) -> bool:
  """True for a line of gloo's connection chatter, and only for it."""
  return GLOO_CHATTER.fullmatch(line) is not None


def strip_chatter(line: str, after_chatter: bool = False) -> str | None:
  """``line`` without gloo's chatter, or None when nothing else is left.

  Whole chatter lines go; so does a line made only of its pieces (and numbers), and a
  bare number right after a chatter line (a piece of it). A piece inside other text is
  cut out of it.
  """
  if is_chatter(line):
    return None
  if GLOO_PIECE.search(line):
    rest = GLOO_PIECE.sub("", line)
    return None if not rest.strip() or rest.strip().isdigit() else rest
  if after_chatter and line.strip().isdigit():
    return None
  return line


class ErrorLines:
  """The ``error:`` lines of the processes: each text printed once, by the lowest process
  that printed it within ``hold_s``, the others that print it alike counted.

  An error that every process meets (bad input, a refused setting) would otherwise be
  printed once per process. The pumps ``add`` such lines instead of writing them; the
  launcher's loop calls ``flush`` (which prints those held ``hold_s`` or longer) and,
  at the end, ``summary``.
  """

  def __init__(self, out, hold_s: float = 1.0):
    self.out, self.hold_s = out, hold_s
    self._lock = threading.Lock()
    self._held: list[tuple[float, int, str]] = []  # (when, process, line)
    self._by_text: dict[str, list[int]] = {}  # processes that printed it, the printer first

  def add(self, process: int, line: str) -> None:
    with self._lock:
      self._held.append((time.monotonic(), process, line))

  def flush(self, everything: bool = False) -> None:
    with self._lock:
      due = time.monotonic() - self.hold_s
      ready = [h for h in self._held if everything or h[0] <= due]
      self._held = [h for h in self._held if h not in ready]
      for _, process, line in sorted(ready, key=lambda h: h[1]):
        printed_by = self._by_text.setdefault(line, [])
        printed_by.append(process)
        if len(printed_by) == 1:
          self.out.write(f"[{process}] {line}")
      self.out.flush()

  def summary(self) -> list[str]:
    """One line per error text that more than one process printed."""
    self.flush(everything=True)
    return [f"[launch] the error of process {by[0]} above was printed alike by "
            f"{len(by) - 1} other process(es): {_ranges(sorted(by[1:]))}"
            for by in self._by_text.values() if len(by) > 1]


def _ranges(numbers: list[int]) -> str:
  """``[1, 2, 3, 5]`` -> ``1-3, 5``."""
  spans: list[list[int]] = []
  for n in numbers:
    if spans and n == spans[-1][1] + 1:
      spans[-1][1] = n
    else:
      spans.append([n, n])
  return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _pump(stream, prefix: str, out, errors: ErrorLines | None = None,
          process: int | None = None) -> None:
  after_chatter = False
  for line in iter(stream.readline, b""):
    text = strip_chatter(line.decode(errors="replace"), after_chatter)
    after_chatter = text is None
    if text is None:
      continue
    if not text.endswith("\n"):  # a process killed mid-line: its last words end a line
      text += "\n"
    if errors is not None and text.startswith("error: "):
      errors.add(process, text)
      continue
    out.write(prefix + text)
    out.flush()


def launch(command: list[str], processes: int, *, devices_per_process: int | None = None,
           grace_s: float = 10.0, port: int | None = None, survivor_s: float = 60.0,
           run_on: bool = False) -> int:
  """Run ``command`` ``processes`` times as one job; returns the job's exit status.

  Args:
    command: the program and its arguments.
    processes: how many processes.
    devices_per_process: CPU devices each simulates (``XLA_FLAGS``); default:
      ``train.py`` derives it from ``mesh.dp * mesh.tp / processes``.
    grace_s: seconds between SIGTERM and SIGKILL when stopping the others.
    survivor_s: after a process fails, seconds the others get to end by themselves
      (they name the lost process and may write a just-in-time checkpoint,
      ``distributed.jit_checkpoint_s``) before they are stopped.
    run_on: never stop the others after a failure (``distributed.recoverable``: they go
      on without the failed processes); each process that ends with a non-zero status is
      said in one line. The launcher then hosts JAX's coordination service itself
      (``processes.service``), so that any process, process 0 included, can be lost; the
      job's status is that of the processes that ended last (they carried it to its end:
      the first non-zero among them, else 0).
    port: the coordinator's port (default: a free one).

  SIGTERM and SIGINT sent to the launcher while it runs (in the main thread) are passed on
  to every process still running; the status is then the processes' own.

  Returns:
    0 when every process ended with 0 (after a stop signal too), else the first non-zero
    status (a process killed by a signal counts as 128 + the signal).
  """
  address = f"127.0.0.1:{port or free_port()}"
  service = serve(address, processes) if run_on else None  # no worker hosts it
  children = []
  pumps = []
  errors = ErrorLines(sys.stdout)
  for i in range(processes):
    env = dict(os.environ, **{ENV_COORDINATOR: address, ENV_NUM_PROCESSES: str(processes),
                              ENV_PROCESS_ID: str(i), ENV_LAUNCHER_PID: str(os.getpid()),
                              "PYTHONUNBUFFERED": "1"})
    if service is not None:
      env[ENV_EXTERNAL_SERVICE] = "1"
    if devices_per_process:
      flags = env.get("XLA_FLAGS", "")
      env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
    # A session of its own: a terminal's Ctrl-C reaches the launcher only, which passes it on
    # once to each process (not twice, which would skip the checkpoint).
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    children.append(child)
    pump = threading.Thread(target=_pump, args=(child.stdout, f"[{i}] ", sys.stdout, errors, i),
                            daemon=True)
    pump.start()
    pumps.append(pump)
  codes: dict[int, int] = {}  # exit status by process, in the order they ended
  last_round: list[int] = []  # the processes that ended last (in one poll round)
  first_failed = None
  failed_at = None  # when the first process failed: the others' time runs from there
  running = set(range(processes))
  previous = _pass_on_stop_signals(children, running)
  try:
    while running:
      errors.flush()
      if failed_at is not None and not run_on and time.monotonic() - failed_at > survivor_s:
        print(f"[launch] stopping processes {sorted(running)} ({survivor_s:g} s after the "
              "failure)", file=sys.stderr, flush=True)
        _stop(children, running, grace_s)
        failed_at = float("inf")
      ended = [i for i in sorted(running) if children[i].poll() is not None]
      if ended:
        last_round = ended
      for i in ended:
        code = children[i].poll()
        running.discard(i)
        codes[i] = code if code >= 0 else 128 - code
        if codes[i] != 0 and (first_failed is None or run_on):
          if first_failed is None:
            first_failed, failed_at = i, time.monotonic()
          then = ("the others run on" if run_on else
                  f"the others have {survivor_s:g} s to end by themselves")
          print(f"[launch] process {i} exited with status {codes[i]}; {then}",
                file=sys.stderr, flush=True)
      time.sleep(0.1)
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    if service is not None:
      service.shutdown()
  for pump in pumps:
    pump.join(timeout=5)
  for line in errors.summary():
    print(line, file=sys.stderr, flush=True)
  aborted = sorted(i for i, c in codes.items() if i != 0 and c == 128 + signal.SIGABRT)
  if first_failed == 0 and aborted:
    print(f"[launch] process 0 hosted JAX's coordination service: losing it ended processes "
          f"{aborted} (status {128 + signal.SIGABRT}, JAX's check failure above); the "
          "checkpoints already written are complete (orbax commits a step whole): run the "
          "job again to resume from the last one", file=sys.stderr, flush=True)
  if first_failed is None:
    return 0
  if run_on:  # those that carried the job to its end: the last to end (in one poll round)
    return next((codes[i] for i in last_round if codes[i] != 0), 0)
  return codes[first_failed]


def _pass_on_stop_signals(children, running: set[int]) -> dict[int, object]:
  """Pass each SIGTERM and SIGINT the launcher gets on to the process groups still running
  (the trainer stops every process at one agreed step and writes one checkpoint; a second
  Ctrl-C, passed on too, stops them at once). Returns the handlers replaced (none outside the
  main thread, where Python cannot install any)."""
  if threading.current_thread() is not threading.main_thread():
    return {}

  def pass_on(signum, frame):
    print(f"[launch] {signal.Signals(signum).name}: passed on to processes {sorted(running)}; "
          "they stop after the step in flight", file=sys.stderr, flush=True)
    for i in sorted(running):
      with contextlib.suppress(ProcessLookupError):  # ended since the last poll
        os.killpg(children[i].pid, signum)

  return {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGINT)}


def _stop(children, which, grace_s: float) -> None:
  """SIGTERM the process groups of ``which``, SIGKILL what is left after ``grace_s``."""
  for i in which:
    if children[i].poll() is None:
      os.killpg(children[i].pid, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  for i in which:
    try:
      children[i].wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      os.killpg(children[i].pid, signal.SIGKILL)
      children[i].wait()


def check_command(command: list[str], processes: int,
                  devices_per_process: int | None = None) -> None:
  """For a ``train.py`` command: read its config (``--config FILE`` and ``--config.FIELD=VALUE``
  overrides) and check it and the job's layout, as every process would.

  Raises:
    ConfigError: one line naming the file or the field (``training.cli``,
      ``RunConfig.from_config``, ``processes.job_layout.check_job_layout``).
  """
  script = next((i for i, arg in enumerate(command) if os.path.basename(arg) == "train.py"),
                None)
  if script is None:  # another program: its own checks speak
    return
  from absl import flags
  from ml_collections import config_flags

  from ntp_jax.processes.job_layout import check_job_layout
  from ntp_jax.training.cli import parse_command_line
  from ntp_jax.training.config import RunConfig
  args = command[script + 1:]
  config_args = [arg for i, arg in enumerate(args) if CONFIG_ARG.match(arg) or (
      i > 0 and args[i - 1] in ("--config", "-config"))]
  argv = ["train.py", *config_args]
  flag_values = flags.FlagValues()
  # ml_collections finds the overrides in sys.argv unless given its own
  config_flags.DEFINE_config_file("config", None, flag_values=flag_values, sys_argv=argv)
  # The config file imports from its repository (configs.base), as it would in train.py.
  sys.path.insert(0, os.path.dirname(os.path.abspath(command[script])))
  try:
    parse_command_line(argv, flag_values)
  finally:
    sys.path.pop(0)
  run_config = RunConfig.from_config(flag_values["config"].value,
                                     config_flags.get_config_filename(flag_values["config"]))
  if processes > 1:
    check_job_layout(run_config.mesh.tp, run_config.mesh.dp,
                     run_config.distributed.processes_per_domain, processes, devices_per_process)


CONFIG_ARG = re.compile(r"--?config(?:[.=].*)?")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m ntp_jax.launch",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=int, required=True, help="processes to start")
  parser.add_argument("--devices-per-process", type=int, default=None,
                      help="CPU devices per process (default: mesh.dp * mesh.tp / processes)")
  parser.add_argument("--survivor-time", type=float, default=60.0,
                      help="after a process fails, seconds the others get to end by themselves "
                           "(a just-in-time checkpoint) before they are stopped (default: 60)")
  parser.add_argument("--run-on", action="store_true",
                      help="never stop the others after a failure (distributed.recoverable: "
                           "they go on without it); the status is then theirs")
  parser.add_argument("--grace", type=float, default=10.0,
                      help="seconds between SIGTERM and SIGKILL when stopping the others "
                           "(default: 10)")
  parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("no command: give it after --, e.g. -- python train.py --config ...")
  if args.processes < 1:
    parser.error(f"--processes: must be >= 1, got {args.processes}")
  from ntp_jax.errors import ConfigError
  try:
    check_command(command, args.processes, args.devices_per_process)
  except ConfigError as err:  # what every process would print: once, before any starts
    print(f"error: {err}", file=sys.stderr)
    return 2
  return launch(command, args.processes, devices_per_process=args.devices_per_process,
                grace_s=args.grace, port=args.port, survivor_s=args.survivor_time,
                run_on=args.run_on)


if __name__ == "__main__":
  sys.exit(main())
