"""Uneven all-gather and reduce-scatter across processes (run by tests/system/test_multiprocess.py).

  python -m ntp_jax.launch --processes 2 --devices-per-process 4 -- \
      python tests/programs/gloo_collectives.py REPS

One TP group of 8 slots over two processes' CPU devices, float64 blocks of
about 2 MiB per device with uneven sizes (one slot holds nothing); each
repetition draws new values (encoding slot and repetition) and every
process checks its own devices' results against numpy. Prints one line per
process: ``process I: REPS repetitions equal numpy``.
"""

import os
import sys

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(os.environ["NTP_JAX_COORDINATOR"],
                           int(os.environ["NTP_JAX_NUM_PROCESSES"]),
                           int(os.environ["NTP_JAX_PROCESS_ID"]))

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ntp_jax.sharding.collectives import all_gather_uneven, reduce_scatter_uneven  # noqa: E402
from ntp_jax.sharding.layout import Layout  # noqa: E402
from ntp_jax.sharding.mesh import TP  # noqa: E402

REPS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
UNITS = (262_147, 262_139, 262_144, 0, 262_151, 262_133, 262_144, 131_071)  # uneven, one empty
layout = Layout(tp=8, live_slots=tuple(range(8)), units=UNITS)
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
mesh = Mesh(np.array(devices), (TP,))
rows = NamedSharding(mesh, P(TP))

gather = jax.jit(jax.shard_map(lambda b: all_gather_uneven(b[0], layout, 0)[None], mesh=mesh,
                               in_specs=P(TP), out_specs=P(TP)))
scatter = jax.jit(jax.shard_map(lambda x: reduce_scatter_uneven(x[0], layout, 0)[None],
                                mesh=mesh, in_specs=P(TP), out_specs=P(TP)))


def slot_values(slot: int, rep: int, n: int) -> np.ndarray:
  """Values that say which slot and repetition made them."""
  return slot * 1e7 + rep * 1e-3 + np.arange(n, dtype=np.float64)


def blocks(rep: int) -> np.ndarray:
  out = np.zeros((8, layout.block))
  for s, n in enumerate(layout.sizes):
    out[s, :n] = slot_values(s, rep, n)
  return out


for rep in range(REPS):
  padded = blocks(rep)
  logical = np.concatenate([padded[s, :n] for s, n in enumerate(layout.sizes)])
  gathered = gather(jax.make_array_from_callback(padded.shape, rows, lambda i, x=padded: x[i]))
  for shard in gathered.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data)[0], logical)

  partial = np.stack([np.sin(np.arange(layout.size) + s + rep) * (s + 1) for s in range(8)])
  total = partial.sum(axis=0)
  scattered = scatter(jax.make_array_from_callback(partial.shape, rows, lambda i, x=partial: x[i]))
  for shard in scattered.addressable_shards:
    s = shard.index[0].start
    expected = np.zeros(layout.block)
    size, offset = layout.sizes[s], layout.offsets[s]
    expected[:size] = total[offset:offset + size]
    np.testing.assert_allclose(np.asarray(shard.data)[0], expected, rtol=1e-12, atol=1e-9)

print(f"process {jax.process_index()}: {REPS} repetitions equal numpy "
      f"(block {layout.block * 8 / 2**20:.1f} MiB float64 per device)", flush=True)
