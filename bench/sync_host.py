"""Host-side time of the cross-class gradient sync against the parameter count.

  python bench/sync_host.py [--steps 20] [--out docs/bench_sync_host.md]

Two models of Llama-3-8B's parameter list at small dimensions: 32 unstacked
blocks (wq, wk, wv, wo, two norms, gate, up, down: 9 each) plus embedding,
final norm and head, 291 parameters, against one block 32 times as wide (the
same gradient bytes), 12 parameters. Each trains on 8 CPU devices as two
replicas of TP degree 4 and 3 (``mesh.dp=2 mesh.tp=4 ntp.failed=1:2``).
Reported per step, after compilation: the time the host spends in
``CrossClassSync.__call__`` (assembling the peer-group buffers, dispatching
the all-reduce, handing the results back; timed on ready buffers with the
devices idle, not waiting for the all-reduce) and the whole step's wall
time. The sync moves a few buffers per device (one per dtype and stack of
layers), so its host time should not grow with the parameter count.
"""

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import emit, simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from examples.mlp_lm import MLPLayouts, mlp_layouts  # noqa: E402
from ntp_jax.layers import (  # noqa: E402
  ColumnParallelLinear,
  RMSNorm,
  RowParallelLinear,
  SwiGLU,
  VocabParallelEmbed,
  vocab_parallel_cross_entropy,
)
from ntp_jax.parallel.plan import make_plan  # noqa: E402
from ntp_jax.parallel.programs import build_class_programs, class_batch  # noqa: E402
from ntp_jax.parallel.step_modes import make_job_step  # noqa: E402

D_MODEL, D_FF, VOCAB, SEQ = 32, 96, 128, 16
BLOCKS = 32


class Block(nnx.Module):
  """Llama's nine parameters per block, in a cheap stand-in computation."""

  def __init__(self, layouts: MLPLayouts, *, rngs: nnx.Rngs):
    # Every block's width is layouts.ffn's: the one-block model is BLOCKS times as wide.
    self.attn_norm = RMSNorm(D_MODEL)
    self.wq = ColumnParallelLinear(D_MODEL, layouts.ffn, rngs=rngs)
    self.wk = ColumnParallelLinear(D_MODEL, layouts.ffn, rngs=rngs)
    self.wv = ColumnParallelLinear(D_MODEL, layouts.ffn, rngs=rngs)
    self.wo = RowParallelLinear(layouts.ffn, D_MODEL, rngs=rngs)
    self.mlp_norm = RMSNorm(D_MODEL)
    self.mlp = SwiGLU(D_MODEL, layouts.ffn, rngs=rngs)

  def __call__(self, x):
    h = self.attn_norm(x)
    x = x + self.wo(self.wq(h) * self.wk(h) + self.wv(h))
    return x + self.mlp(self.mlp_norm(x))


class WideLM(nnx.Module):
  def __init__(self, layouts: MLPLayouts, n_blocks: int, *, rngs: nnx.Rngs):
    self.layouts = layouts
    self.embed = VocabParallelEmbed(layouts.vocab, D_MODEL, rngs=rngs)
    self.blocks = nnx.List([Block(layouts, rngs=rngs) for _ in range(n_blocks)])
    self.final_norm = RMSNorm(D_MODEL)
    self.head = ColumnParallelLinear(D_MODEL, layouts.vocab, rngs=rngs)

  def loss_sum(self, tokens, targets):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    logits = self.head(self.final_norm(x))
    return jnp.sum(vocab_parallel_cross_entropy(logits, targets, self.layouts.vocab))


def measure(n_blocks: int, steps: int) -> tuple[int, int, float, float]:
  """(parameters, logical gradient elements, median host seconds in the sync, median step
  seconds) of ``n_blocks`` blocks of width ``D_FF * BLOCKS / n_blocks``."""
  layouts = functools.partial(mlp_layouts, D_FF * BLOCKS // n_blocks, VOCAB)
  plan = make_plan(layouts, tp=4, dp=2, failed={(1, 2)}, batch_size=8)
  make = lambda layouts: WideLM(layouts, n_blocks, rngs=nnx.Rngs(0))  # noqa: E731
  programs = build_class_programs(plan, make, optax.adamw(1e-3), 1.0, plan.global_batch * SEQ,
                                  jax.devices()[:8])
  job = make_job_step(plan, programs)
  flat = nnx.to_flat_state(programs[0].params)
  count = len(flat)
  elements = sum(int(np.prod(v.get_value().shape)) for _, v in flat)
  rng = np.random.default_rng(0)
  step_times = []
  for _ in range(steps + 2):  # two to compile and warm up
    batch = rng.integers(0, VOCAB, (plan.global_batch, SEQ + 1), dtype=np.int32)
    start = time.perf_counter()
    float(job(batch)["loss"])
    step_times.append(time.perf_counter() - start)
  # The sync alone, on ready buffers and idle devices: the host's own work.
  buffers = [p.step.gradients(p.params, class_batch(p, batch, first))
             for p, (first, _) in zip(programs, plan.class_rows())]
  jax.block_until_ready(buffers)
  sync_times = []
  for _ in range(steps + 2):
    start = time.perf_counter()
    synced = job.sync(buffers)
    sync_times.append(time.perf_counter() - start)
    jax.block_until_ready(synced)
  return count, elements, statistics.median(sync_times[2:]), statistics.median(step_times[2:])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  rows = [measure(n, args.steps) for n in (1, BLOCKS)]
  lines = [f"`python bench/sync_host.py --steps {args.steps}` ({jax.devices()[0].platform}, "
           f"8 devices, TP degrees 4 + 3, d_model {D_MODEL}, median of {args.steps} steps)", "",
           "| parameters | parameter elements (stored, class 0) | host time in the sync (ms) "
           "| step time (ms) |", "|---|---|---|---|"]
  for count, elements, sync_s, step_s in rows:
    lines.append(f"| {count} | {elements:,} | {sync_s * 1e3:.2f} | {step_s * 1e3:.1f} |")
  lines += ["", f"sync host time, {rows[1][0]} / {rows[0][0]} parameters: "
            f"{rows[1][2] / rows[0][2]:.2f}x"]
  emit(lines, args.out)


if __name__ == "__main__":
  main()
