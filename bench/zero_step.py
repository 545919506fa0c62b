"""The sharded optimizer's step (zero1, zero2) against the replicated one: step time and
state bytes.

  python bench/zero_step.py [--config configs/gpt_small.py] [--mesh 2x4] [--failed 1:3]
                            [--sharding zero1,zero2] [--microbatches 2]

For each choice (replicated; each ``--sharding`` with each ``--copies``) the same plan
(``--mesh``
DP x TP on 8 simulated devices, ``--failed`` slots) trains ``--steps`` steps on random
tokens after two warm-up steps. Reported: the median step time and its ratio to the
replicated one (measured in this run, one after the other), and the bytes one core
device holds of the optimizer state (replicated: its class blocks of the Adam moments;
zero1/zero2: its pieces of float32 master weights and moments) and of the parameters,
each replica's share run as ``--microbatches`` micro-batches. Run it alone: two cores
shared with other work distort every time.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import emit, load_config, simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ntp_jax.model import load_model_spec  # noqa: E402
from ntp_jax.parallel.programs import build_class_programs  # noqa: E402
from ntp_jax.parallel.step_modes import make_job_step  # noqa: E402
from ntp_jax.training.config import RunConfig  # noqa: E402
from ntp_jax.training.loop import plan_for  # noqa: E402
from ntp_jax.training.optim import make_optimizer, zero_settings  # noqa: E402


def on_one_device(tree, device) -> int:
  """Bytes of ``tree``'s arrays held on ``device``."""
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)


def measure(path, mesh, failed, sharding, copies, steps, batch, seq, microbatches):
  config = load_config(path)
  config.mesh.dp, config.mesh.tp = mesh
  config.ntp.failed = failed
  config.train.microbatches = microbatches
  config.train.batch_size, config.train.seq_len = batch, seq
  config.train.optimizer_sharding, config.train.optimizer_copies = sharding, copies
  config = RunConfig.from_config(config)
  model = load_model_spec(config.model.factory, config.source)
  plan = plan_for(config, model, config.ntp.failed)
  zero = zero_settings(config.train)
  programs = build_class_programs(plan, model.make, make_optimizer(config.train),
                                  config.train.clip_norm, plan.global_batch * seq,
                                  jax.devices(), loss=model.loss, split=zero is not None)
  job = make_job_step(plan, programs, split=zero is not None, zero=zero)
  rng = np.random.default_rng(0)
  rows = [rng.integers(0, model.vocab_size, (plan.global_batch, seq + 1), np.int32)
          for _ in range(steps + 2)]
  times = []
  for i, batch_rows in enumerate(rows):
    start = time.perf_counter()
    float(job(batch_rows)["loss"])
    jax.block_until_ready([p.params for p in programs])
    if i >= 2:
      times.append(time.perf_counter() - start)
  device = programs[0].mesh.devices[0, 0]  # a core device
  opt = job.zero_state if zero is not None else programs[0].opt_state
  return (statistics.median(times), on_one_device(opt, device),
          on_one_device(programs[0].params, device))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/gpt_small.py")
  parser.add_argument("--mesh", default="2x4", help="DP x TP, at most 8 devices")
  parser.add_argument("--failed", default="1:3")
  parser.add_argument("--sharding", default="zero1,zero2")
  parser.add_argument("--copies", default="1,2")
  parser.add_argument("--microbatches", type=int, default=1)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--out", default="")
  args = parser.parse_args()
  choices = [("replicated", 1)] + [(s, int(k)) for s in args.sharding.split(",")
                                   for k in args.copies.split(",")]
  mesh = tuple(int(n) for n in args.mesh.split("x"))
  rows = [measure(args.config, mesh, args.failed, s, k, args.steps, args.batch, args.seq,
                  args.microbatches) for s, k in choices]
  base = rows[0][0]
  lines = [f"`python bench/zero_step.py --config {args.config} --mesh {args.mesh} --failed "
           f"'{args.failed}' --sharding {args.sharding} --copies {args.copies} --microbatches "
           f"{args.microbatches} --steps {args.steps} --batch {args.batch} --seq {args.seq}` "
           "(cpu)",
           "", "| optimizer state | step (median) | / replicated | optimizer state on a core "
           "device (MB) | parameters on it (MB) |", "|---|---:|---:|---:|---:|"]
  for (sharding, k), (step, opt, params) in zip(choices, rows):
    name = sharding if sharding == "replicated" else f"{sharding}, k={k}"
    lines.append(f"| {name} | {step:.3f} s | {step / base:.2f} | {opt / 1e6:.1f} | "
                 f"{params / 1e6:.1f} |")
  emit(lines, args.out)


if __name__ == "__main__":
  main()
