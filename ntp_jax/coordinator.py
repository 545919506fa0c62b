"""JAX's coordination service on its own: ``python -m ntp_jax.coordinator --processes N``.

For a cluster job whose every worker may be lost (``distributed.recoverable``):
run this beside ``srun`` (on the batch script's node), and start the workers with
``--config.distributed.external_coordinator=True`` and its address as
``distributed.coordinator``; no worker then hosts the service, so losing
process 0 is survived like losing any other (``processes.service``; an sbatch
example in docs/multihost.md). It serves until SIGTERM or Ctrl-C; losing it
ends the job (every worker stops within its heartbeat timeout, with one line).
``python -m ntp_jax.launch --run-on`` does the same on one machine by itself.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from ntp_jax.processes.service import SERVICE_HEARTBEAT_S, serve


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m ntp_jax.coordinator",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=int, required=True, help="workers in the job")
  parser.add_argument("--port", type=int, default=1234, help="port to serve on")
  parser.add_argument("--bind", default="[::]",
                      help="address to bind (default: every address of this host)")
  parser.add_argument("--heartbeat-timeout", type=int, default=SERVICE_HEARTBEAT_S,
                      help="seconds of silence after which JAX's service takes a worker for "
                           "dead (ours, distributed.heartbeat_timeout_s, should be shorter)")
  args = parser.parse_args(argv)
  if args.processes < 1:
    parser.error(f"--processes: must be >= 1, got {args.processes}")
  service = serve(f"{args.bind}:{args.port}", args.processes,
                  heartbeat_timeout_s=args.heartbeat_timeout)
  done = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: done.set())
  print(f"coordination service for {args.processes} processes on {args.bind}:{args.port}",
        flush=True)
  done.wait()
  service.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
