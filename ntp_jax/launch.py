"""Start a multi-process job on this machine: ``python -m ntp_jax.launch --processes N -- CMD``.

For trying multi-process runs without a cluster. Starts ``N`` copies of
``CMD`` (e.g. ``python train.py --config configs/gpt_tiny.py``), each told
its place through ``NTP_JAX_COORDINATOR`` (127.0.0.1 and a free port),
``NTP_JAX_NUM_PROCESSES`` and ``NTP_JAX_PROCESS_ID`` (read by
``ntp_jax.processes.distributed``), with its own CPU devices and gloo collectives.
Every output line is prefixed with ``[i]``; gloo's connection chatter is
dropped (``is_chatter``). When one process fails, the others are stopped
(SIGTERM, then SIGKILL after ``--grace`` seconds) and the launcher exits
with the first failure's status.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from ntp_jax.processes.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID
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


def _pump(stream, prefix: str, out) -> None:
  after_chatter = False
  for line in iter(stream.readline, b""):
    text = strip_chatter(line.decode(errors="replace"), after_chatter)
    after_chatter = text is None
    if text is None:
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

  Returns:
    0 when every process ended with 0, else the first non-zero status
    (a process killed by a signal counts as 128 + the signal).
  """
  address = f"127.0.0.1:{port or free_port()}"
  service = serve(address, processes) if run_on else None  # no worker hosts it
  children = []
  pumps = []
  for i in range(processes):
    env = dict(os.environ, **{ENV_COORDINATOR: address, ENV_NUM_PROCESSES: str(processes),
                              ENV_PROCESS_ID: str(i), "PYTHONUNBUFFERED": "1"})
    if service is not None:
      env[ENV_EXTERNAL_SERVICE] = "1"
    if devices_per_process:
      flags = env.get("XLA_FLAGS", "")
      env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
    children.append(child)
    pump = threading.Thread(target=_pump, args=(child.stdout, f"[{i}] ", sys.stdout),
                            daemon=True)
    pump.start()
    pumps.append(pump)
  codes: dict[int, int] = {}  # exit status by process, in the order they ended
  last_round: list[int] = []  # the processes that ended last (in one poll round)
  first_failed = None
  failed_at = None  # when the first process failed: the others' time runs from there
  try:
    running = set(range(processes))
    while running:
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
  except KeyboardInterrupt:
    _stop(children, set(range(processes)), grace_s)
    return 130
  finally:
    if service is not None:
      service.shutdown()
  for pump in pumps:
    pump.join(timeout=5)
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


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m ntp_jax.launch", description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--processes", type=int, required=True, help="processes to start")
  parser.add_argument("--devices-per-process", type=int, default=None,
                      help="CPU devices per process (default: mesh.dp * mesh.tp / processes)")
  parser.add_argument("--survivor-time", type=float, default=60.0,
                      help="after a process fails, seconds the others get to end by themselves "
                           "(a just-in-time checkpoint) before they are stopped")
  parser.add_argument("--run-on", action="store_true",
                      help="never stop the others after a failure (distributed.recoverable: "
                           "they go on without it); the status is then theirs")
  parser.add_argument("--grace", type=float, default=10.0,
                      help="seconds between SIGTERM and SIGKILL when stopping the others")
  parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("no command: give it after --, e.g. -- python train.py --config ...")
  if args.processes < 1:
    parser.error(f"--processes: must be >= 1, got {args.processes}")
  return launch(command, args.processes, devices_per_process=args.devices_per_process,
                grace_s=args.grace, port=args.port, survivor_s=args.survivor_time,
                run_on=args.run_on)


if __name__ == "__main__":
  sys.exit(main())
