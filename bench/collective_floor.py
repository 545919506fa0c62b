"""One collective of a number of bytes between two processes: the floor of a live move across
processes (``bench/recovery_processes.py``).

  python -m ntp_jax.launch --processes 2 --devices-per-process 4 -- \\
      python bench/collective_floor.py BYTES

The devices and the failure of ``recovery_processes.py``'s live case: 2 processes x 4 CPU
devices, slot 2 of process 1 failed, the seven others live. Over the live devices (one mesh
axis, in ``jax.devices()`` order, as the move's own program), one ``jax.lax.ppermute`` sends
``BYTES`` in float32 from process 0's device 2 (the one device that holds the failed slot's
units) to process 1's device 0, compiled first. Process 0 prints one line:
``first_s=SECONDS collective_s=SECONDS``: the program's first run, which is also the first
collective ever over this set of devices (gloo connects them then, as it does for the move's
own first run after a failure), and the fastest of the ten runs after it.
"""

import os
import sys
import time

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(os.environ["NTP_JAX_COORDINATOR"],
                           int(os.environ["NTP_JAX_NUM_PROCESSES"]),
                           int(os.environ["NTP_JAX_PROCESS_ID"]))

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

AXIS = "live"
FAILED_SLOT, SENDING_SLOT, RECEIVING_SLOT = 2, 2, 0


def main():
  total = int(sys.argv[1])
  by_process = [[d for d in jax.devices() if d.process_index == p] for p in (0, 1)]
  if any(len(devices) != 4 for devices in by_process) or jax.process_count() != 2:
    raise SystemExit("collective_floor.py: needs 2 processes x 4 devices "
                     "(--processes 2 --devices-per-process 4)")
  live = [d for d in jax.devices() if d is not by_process[1][FAILED_SLOT]]
  pair = (live.index(by_process[0][SENDING_SLOT]), live.index(by_process[1][RECEIVING_SLOT]))
  length = max(1, total // 4)
  mesh = Mesh(np.array(live, dtype=object), (AXIS,))
  sharding = NamedSharding(mesh, P(AXIS))
  permute = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, AXIS, [pair]), mesh=mesh,
                                  in_specs=P(AXIS), out_specs=P(AXIS)))
  local = [jax.device_put(np.ones((1, length), np.float32), d)
           for d in live if d.process_index == jax.process_index()]
  x = jax.make_array_from_single_device_arrays((len(live), length), sharding, local)
  compiled = permute.lower(x).compile()
  seconds = []
  for _ in range(11):
    start = time.perf_counter()
    jax.block_until_ready(compiled(x))
    seconds.append(time.perf_counter() - start)
  if jax.process_index() == 0:
    print(f"first_s={seconds[0]:.6f} collective_s={min(seconds[1:]):.6f}", flush=True)


if __name__ == "__main__":
  main()
