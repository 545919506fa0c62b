"""Cost of checkpoints: step time with and without a save every step, save and restore time,
bytes on disk against logical bytes, and host memory of a large restore onto 8 slots.

  python bench/checkpoint.py [--config configs/gpt_small.py] [--steps 8] [--large-mib 512]
                             [--out docs/bench_checkpoint.md]

One process, 8 simulated CPU devices (one TP group of 8), random tokens. The
saves are orbax's asynchronous ones: ``save stall`` is the time a step is
held (the device-side move to the even layout and the copy off the devices);
the write goes on in the background. On CPU the background write shares the
same cores as the next steps, which an accelerator would not. The restore
goes onto another plan (slot 3 failed: TP degree 7), as after a failure.

The large-array part runs in a subprocess: one ``[rows, 8192]`` float32
array written from 8 slots, then restored onto 8 slots of another layout
(7 live slots of 8); it reports the bytes each device reads and the growth
of the process's peak resident memory, against the array's size. Simulated
devices live in host memory, so the restored array itself counts once;
a restore that read the whole array on the host first would count twice.
"""

import argparse
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import emit, load_config, progress  # noqa: E402
from flax import nnx  # noqa: E402

from models.gpt import GPT, GPTConfig, model_layouts  # noqa: E402
from ntp_jax.parallel.plan import make_plan  # noqa: E402
from ntp_jax.parallel.programs import build_class_programs, logical_state  # noqa: E402
from ntp_jax.parallel.step_modes import make_job_step  # noqa: E402
from ntp_jax.state.checkpoint import Checkpoints  # noqa: E402
from ntp_jax.training.config import parse_failed  # noqa: E402
from ntp_jax.training.optim import make_optimizer  # noqa: E402


def build(cfg, config, failed="", source=None):
  plan = make_plan(functools.partial(model_layouts, cfg), tp=8, dp=1,
                   failed=parse_failed(failed, 1, 8),
                   batch_size=config.train.batch_size)
  programs = build_class_programs(
      plan, lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(0)), make_optimizer(config.train),
      config.train.clip_norm, plan.global_batch * config.train.seq_len, jax.devices()[:8],
      source=source)
  return plan, programs


def batch(cfg, config, rows, step):
  return np.asarray(jax.random.randint(jax.random.key(step), (rows, config.train.seq_len + 1),
                                       0, cfg.vocab_size), np.int32)


def run_steps(cfg, config, plan, job, steps, first, store=None):
  """Median step time (s) and median save stall (s) over ``steps`` steps."""
  times, stalls = [], []
  for step in progress(range(first, first + steps), "saving" if store else "steps"):
    start = time.perf_counter()
    float(job(batch(cfg, config, plan.global_batch, step))["loss"])
    if store is not None:
      held = time.perf_counter()
      store.save(step + 1, logical_state(job.programs), {"data_cursor": 0})
      stalls.append(time.perf_counter() - held)
    times.append(time.perf_counter() - start)
  return statistics.median(times), statistics.median(stalls) if stalls else 0.0


def folder_bytes(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


LARGE_COMMON = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, {root!r})
import jax, numpy as np
from ntp_jax.state.checkpoint import Checkpoints
from ntp_jax.sharding.layout import make_layout
from ntp_jax.layers.params import TPParam
from ntp_jax.sharding.mesh import class_mesh
from ntp_jax.state.placement import place_logical, read_logical
from ntp_jax.state.sources import ArraySource

rows, cols = {rows}, 8192
def target(failed):
  layout = make_layout(rows, 8, failed=failed)
  block = jax.ShapeDtypeStruct((1, layout.degree, layout.block, cols), np.float32)
  return {{"params": {{"w": TPParam(block, tp_layout=layout, tp_axis=0)}}}}, class_mesh(
      [0], [layout.live_slots], 8)
store = Checkpoints({path!r})

def high_water():  # bytes; VmHWM starts afresh at exec (ru_maxrss would keep the parent's)
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
"""

LARGE_WRITE = LARGE_COMMON + """
tree, mesh = target(())
values = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
state, _ = place_logical(tree, mesh, ArraySource({{("params", "w"): values}}))
store.save(0, read_logical(state, mesh), {{}})
store.close()
"""

# A fresh process, so that its peak resident memory measures the restore alone.
LARGE_RESTORE = LARGE_COMMON + """
tree, mesh = target((3,))
jax.block_until_ready(jax.device_put(np.zeros(8), jax.devices()[0]))  # start the runtime
before = high_water()
from ntp_jax.state.placement import leaves_of
leaf = leaves_of(tree)[0][0]
pieces = store.source(0).read({{leaf.path: leaf.abstract(leaf.even_sharding(mesh))}})
jax.block_until_ready(pieces)
read_peak = high_water()
per_device = {{s.data.nbytes for s in pieces[leaf.path].addressable_shards}}
del pieces
start = time.perf_counter()
state, _ = place_logical(tree, mesh, store.source(0))
jax.block_until_ready(state)
elapsed = time.perf_counter() - start
peak = high_water()
w = state["params"]["w"].get_value()
layout = tree["params"]["w"].tp_layout
for shard in w.addressable_shards:  # every slot holds its own rows
  j = shard.index[1].start
  got = np.asarray(shard.data)[0, 0, :layout.sizes[j], 0]
  mine = np.arange(layout.offsets[j], layout.offsets[j] + layout.sizes[j])
  assert np.array_equal(got, mine * cols)
print(rows * cols * 4, before, read_peak, peak, elapsed, max(per_device))
"""


def large_restore(rows: int) -> tuple[float, ...]:
  path = tempfile.mkdtemp(prefix="ckpt_large_")
  try:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = ""
    for script in (LARGE_WRITE, LARGE_RESTORE):
      out = subprocess.run([sys.executable, "-c", script.format(root=ROOT, rows=rows, path=path)],
                           capture_output=True, text=True, env=env, check=True).stdout
    size, before, read_peak, peak, elapsed, per_device = map(float, out.split()[-6:])
    return size, read_peak - before, peak - before, elapsed, per_device
  finally:
    shutil.rmtree(path, ignore_errors=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_small.py"))
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--only-large", action="store_true", help="skip the gpt_small part")
  parser.add_argument("--large-mib", type=int, default=512,
                      help="size of the large array restored onto 8 slots (0: skip)")
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  if args.only_large:
    rows = max(7, args.large_mib * 2**20 // (8192 * 4) // 7 * 7)
    print(large_restore(rows))
    return
  config = load_config(args.config)
  cfg = GPTConfig.from_config(config.model)
  plan, programs = build(cfg, config)
  job = make_job_step(plan, programs)
  folder = tempfile.mkdtemp(prefix="ckpt_bench_")
  try:
    store = Checkpoints(folder, keep=2)
    run_steps(cfg, config, plan, job, 2, 0)  # compile
    store.save(2, logical_state(programs), {"data_cursor": 0})  # compile the even-layout move
    store.wait()
    plain, _ = run_steps(cfg, config, plan, job, args.steps, 2)
    with_saves, stall = run_steps(cfg, config, plan, job, args.steps, 2 + args.steps, store)
    start = time.perf_counter()
    last = 2 + 2 * args.steps
    store.save(last + 1, logical_state(programs), {"data_cursor": 0})
    store.wait()
    save_s = time.perf_counter() - start
    logical = sum(np.dtype(a.dtype).itemsize * a.size for a in logical_state(programs).values())
    written = folder_bytes(store.step_dir(last + 1))
    restore = []
    for _ in range(2):  # the first includes compiling the move into the new layout
      start = time.perf_counter()
      _, restored = build(cfg, config, failed="3", source=store.source(last + 1))
      jax.block_until_ready([p.params for p in restored])
      restore.append(time.perf_counter() - start)
    store.close()
  finally:
    shutil.rmtree(folder, ignore_errors=True)

  lines = [f"`python bench/checkpoint.py --config {os.path.relpath(args.config, ROOT)} "
           f"--steps {args.steps} --large-mib {args.large_mib}` "
           f"({jax.devices()[0].platform}, 8 devices, TP 8, {plan.global_batch} x "
           f"{config.train.seq_len} tokens per step)", "",
           "| figure | value |", "|---|---|",
           f"| step time, no checkpoint (median) | {plain:.3f} s |",
           f"| step time, checkpoint every step (median) | {with_saves:.3f} s |",
           f"| ratio | {with_saves / plain:.2f} |",
           f"| save stall per step (median: move to the even layout + copy off the devices) | "
           f"{stall:.3f} s |",
           f"| one save, start to on disk | {save_s:.3f} s |",
           f"| restore onto TP degree 7 (slot 3 failed), first (compiles the move) | "
           f"{restore[0]:.3f} s |",
           f"| restore onto TP degree 7, again | {restore[1]:.3f} s |",
           f"| logical bytes (parameters + Adam moments) | {logical / 1e6:.1f} MB |",
           f"| bytes written | {written / 1e6:.1f} MB ({written / logical:.3f} x logical) |"]
  if args.large_mib:
    rows = max(7, args.large_mib * 2**20 // (8192 * 4) // 7 * 7)
    size, read_growth, growth, elapsed, per_device = large_restore(rows)
    lines += [f"| large array [{rows}, 8192] f32 restored onto 7 of 8 slots | "
              f"{size / 2**20:.0f} MiB in {elapsed:.2f} s |",
              f"| bytes read per device (7 even pieces) | {per_device / 2**20:.1f} MiB "
              f"({per_device / size:.3f} of the array) |",
              f"| peak memory growth, orbax read onto the 7 pieces | {read_growth / 2**20:.0f} MiB "
              f"({read_growth / size:.2f} x the array) |",
              f"| peak memory growth, read + move into padded blocks (devices are host memory "
              f"here) | {growth / 2**20:.0f} MiB ({growth / size:.2f} x the array) |"]
  emit(lines, args.out)


if __name__ == "__main__":
  main()
