"""The live move against its floors: its seconds against a plain copy of the same bytes,
its bytes against the minimum, the first step on the new plan against its steady step.

  python bench/move_floor.py [--config configs/gpt_small.py] [--failed 0:3] [--repeats 3]

One process, 8 simulated CPU devices, the config's model at dp=2 tp=4 with the
trainer's optimizer (``training.optim.make_optimizer``). The healthy plan's state is
built, then moved live from DP peers onto the plan with ``--failed`` slots
(``state.peer.PeerSource`` through ``parallel.programs.build_class_programs``, the
loop's own path), ``--repeats`` times after a first move that compiles; the
figures are the fastest repeat's:

- *move seconds* against a plain ``jax.device_put`` of the same number of bytes
  (one buffer) between two devices of the same set, the fastest of three;
- *bytes moved* against the minimum: what the move's programs carry between
  devices (the collective-permutes of its even-piece and placement programs,
  read from their compiled HLO, ``analysis.hlo_collectives``: per-device result
  bytes times the program's devices), plus the pieces it copies between
  programs (``copied_bytes``); the minimum is, for every leaf (parameters and
  optimizer state) and every device of the new plan, the logical elements it
  holds on the new plan that it did not hold on the old one
  (``Layout.gather_index``), in the class dtype;
- *first step* on the new plan against the median of the next four steps (each
  repeat runs them: the first step follows a move, as after a recovery).

Run it alone: two cores shared with other work distort every figure.
"""

import argparse
import functools
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import load_config, simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from floors import minimum_bytes, plain_copy_seconds  # noqa: E402

from models.gpt import GPT, GPTConfig, model_layouts  # noqa: E402
from ntp_jax.analysis.hlo_collectives import collectives  # noqa: E402
from ntp_jax.parallel.plan import make_plan  # noqa: E402
from ntp_jax.parallel.programs import PlanPrograms, ProgramCache, build_class_programs  # noqa: E402
from ntp_jax.parallel.step_modes import make_job_step  # noqa: E402
from ntp_jax.state.peer import PeerSource  # noqa: E402
from ntp_jax.training.config import RunConfig  # noqa: E402
from ntp_jax.training.optim import make_optimizer  # noqa: E402


def program_bytes(plan, make, optimizer, clip_norm, tokens, seq, devices, cache, source) -> int:
  """Bytes the state-move programs of a move onto ``plan`` carry between devices: each
  collective-permute's per-device result bytes, times the program's devices."""
  total = 0
  for what, _, lowered in PlanPrograms(plan, make, optimizer, clip_norm, tokens, devices,
                                       cache=cache).lower(seq, source):
    if not what.startswith("state move"):
      continue
    compiled = lowered.compile()
    shardings = [s for s in jax.tree.leaves(compiled.input_shardings)
                 if hasattr(s, "device_set")]
    count = max(len(s.device_set) for s in shardings) if shardings else 1
    total += count * sum(c.bytes for c in collectives(compiled.as_text())
                         if c.kind == "collective-permute")
  return total


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_small.py"))
  parser.add_argument("--failed", default="0:3")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq", type=int, default=64)
  args = parser.parse_args()
  config = load_config(args.config)
  config.train.batch_size, config.train.seq_len = args.batch, args.seq
  run = RunConfig.from_config(config)
  cfg = GPTConfig.from_config(config.model)
  make = lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(0))  # noqa: E731
  optimizer = make_optimizer(run.train)
  devices = jax.devices()
  layouts = functools.partial(model_layouts, cfg)
  failed = {tuple(map(int, pair.split(":"))) for pair in args.failed.split(",")}
  healthy = make_plan(layouts, tp=4, dp=2, failed=set(), batch_size=args.batch)
  reduced = make_plan(layouts, tp=4, dp=2, failed=failed, batch_size=args.batch)
  dead = {devices[r * 4 + s] for r, s in failed}
  cache = ProgramCache()
  tokens = reduced.global_batch * args.seq
  build = functools.partial(build_class_programs, optimizer=optimizer,
                            clip_norm=run.train.clip_norm, devices=devices, cache=cache)
  batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (reduced.global_batch,
                                                                 args.seq + 1), np.int32)
  moves, firsts, steadies, copied = [], [], [], 0
  for repeat in range(args.repeats + 1):  # the first compiles
    # A fresh healthy state each time: the steps donate the buffers a move keeps in place.
    old = build(healthy, make, global_tokens=healthy.global_batch * args.seq)
    jax.block_until_ready([(p.params, p.opt_state) for p in old])
    source = PeerSource(old, dead, cache=cache)
    start = time.perf_counter()
    new = build(reduced, make, global_tokens=tokens, source=source)
    jax.block_until_ready([(p.params, p.opt_state) for p in new])
    move_s = time.perf_counter() - start
    step = make_job_step(reduced, new, cache=cache)
    times = []
    for _ in range(5):
      start = time.perf_counter()
      jax.block_until_ready(step(batch)["loss"])
      times.append(time.perf_counter() - start)
    if repeat:
      moves.append(move_s)
      firsts.append(times[0])
      steadies.append(statistics.median(times[1:]))
    copied = source.copied_bytes
  floor = plain_copy_seconds(copied, devices[0], devices[1])
  least = minimum_bytes(old, new)  # from shapes and layouts only: donated buffers are fine
  old = build(healthy, make, global_tokens=healthy.global_batch * args.seq)
  carried = program_bytes(reduced, make, optimizer, run.train.clip_norm, tokens, args.seq,
                          devices, cache, PeerSource(old, dead,
                                                     cache=cache))
  best = int(np.argmin(moves))
  print(f"`python bench/move_floor.py --config {os.path.relpath(args.config, ROOT)} "
        f"--failed {args.failed} --repeats {args.repeats}` ({devices[0].platform}, 8 devices, "
        f"dp=2 tp=4 -> TP degrees {[r.degree for r in reduced.replicas]}, {args.batch} x "
        f"{args.seq} tokens per step)\n")
  print("| figure | value |\n|---|---|")
  print(f"| move, fastest of {args.repeats} (compiled) | {moves[best]:.3f} s |")
  print(f"| plain device_put of the same {copied / 1e6:.1f} MB, fastest of 3 | {floor:.3f} s |")
  print(f"| move / plain copy | {moves[best] / floor:.1f} |")
  print(f"| bytes moved: in its programs' collective-permutes + copied between them | "
        f"{carried / 1e6:.1f} MB + {copied / 1e6:.1f} MB |")
  print(f"| minimum for this failure (from the two plans' layouts) | {least / 1e6:.1f} MB |")
  print(f"| bytes moved / minimum | {(carried + copied) / least:.2f} |")
  print(f"| first step / steady step (median of the next 4) | "
        f"{firsts[best]:.3f} s / {steadies[best]:.3f} s = {firsts[best] / steadies[best]:.2f} |")


if __name__ == "__main__":
  main()
