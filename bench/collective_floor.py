"""One collective of a number of bytes between two processes: the floor of a live move across
processes (``bench/recovery_processes.py``).

  python -m ntp_jax.launch --processes 2 -- python bench/collective_floor.py BYTES

Over every device of the job (one mesh axis), one ``jax.lax.ppermute`` sends ``BYTES`` in
float32 from each device of process 1 to the matching device of process 0 (the bytes split
evenly over the pairs), compiled first; the fastest of five runs. Process 0 prints one line:
``collective_s=SECONDS``.
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


def main():
  total = int(sys.argv[1])
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  senders = [i for i, d in enumerate(devices) if d.process_index == 1]
  receivers = [i for i, d in enumerate(devices) if d.process_index == 0]
  pairs = list(zip(senders, receivers))
  length = max(1, total // 4 // len(pairs))
  mesh = Mesh(np.array(devices), (AXIS,))
  sharding = NamedSharding(mesh, P(AXIS))
  permute = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, AXIS, pairs), mesh=mesh,
                                  in_specs=P(AXIS), out_specs=P(AXIS)))
  local = [jax.device_put(np.ones((1, length), np.float32), d)
           for d in devices if d.process_index == jax.process_index()]
  x = jax.make_array_from_single_device_arrays((len(devices), length), sharding, local)
  jax.block_until_ready(permute(x))  # compiles
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(permute(x))
    best = min(best, time.perf_counter() - start)
  if jax.process_index() == 0:
    print(f"collective_s={best:.6f}", flush=True)


if __name__ == "__main__":
  main()
