"""Bytes the cross-class gradient sync moves per step, from shapes alone (no devices).

  python bench/sync_bytes.py [--config configs/gpt_8b.py] [--out docs/sync_bytes.md]

For each mix of TP degrees: the logical gradient size G, the bytes sent
inside scale-up domains (phases 1 and 3, all replicas together) with the
sync positions the job chooses (``sync.regroup_plan``), with near-equal runs
for every parameter, and for a nested core/extra regroup (every replica of
degree t moves only its extra slots' share, ``2 (t - t_min) / t * G``, which
needs nested layouts: see docs/sync.md); and the bytes sent across domains
(phase 2, all core devices together), next to a uniform-TP DP all-reduce of
the same gradient over the same replicas.

A second table gives, per core device, what crosses domains with each
optimizer-state choice (``train.optimizer_sharding``): the replicated ring
all-reduce of the buffer (``2 (R-1)/R * L``), and ZeRO-1 with ``k`` copies
(``parallel.zero``: ``P = piece_count(R, k)`` pieces, ``C = R / P`` copies):
a reduce-scatter over the pieces (``(P-1)/P * L``), an all-reduce of the
piece over its copies (``2 (C-1)/C * L / P``) and an all-gather of the
updated parameters in their dtype (``(P-1)/P * L``). ZeRO-2 runs the
reduce-scatter and the all-reduce once per micro-batch (``--microbatches m``
rows; their float32 sums stay on the devices) and the all-gather once. ``L``:
the elements of one core position's sync buffer (every parameter's run at
``t_min`` positions, the loss element).
"""

import argparse
import dataclasses
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import emit, load_config, progress  # noqa: E402
from flax import nnx  # noqa: E402

from models.gpt import GPT, GPTConfig, model_layouts  # noqa: E402
from ntp_jax.parallel.plan import make_plan  # noqa: E402
from ntp_jax.parallel.programs import abstract_params  # noqa: E402
from ntp_jax.parallel.sync import plan_regroups, sync_traffic  # noqa: E402
from ntp_jax.parallel.sync_leaf import sync_leaves  # noqa: E402
from ntp_jax.parallel.zero import piece_count  # noqa: E402
from ntp_jax.training.config import parse_failed  # noqa: E402

MIXES = [
    ("8 + 7", 8, 2, "1:3"),
    ("8 + 5", 8, 2, "1:1,1:2,1:4"),
    ("8 + 7 + 6", 8, 3, "1:5,2:0,2:7"),
    ("72 + 70", 72, 2, "1:5,1:40"),
    ("7 x 8 + 7", 8, 8, "7:3"),
]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/gpt_8b.py")
  parser.add_argument("--out", default="")
  parser.add_argument("--microbatches", type=int, default=4,
                      help="micro-batches per step of the zero2 rows")
  args = parser.parse_args()
  config = load_config(args.config)
  cfg = GPTConfig.from_config(config.model)
  itemsize = 2 if cfg.param_dtype == "bfloat16" else 4
  lines = [f"`python bench/sync_bytes.py --config {args.config}` (gradients in "
           f"{cfg.param_dtype}, {itemsize} bytes per element)", "",
           "| TP degrees | G (GB) | inside domains (GB) | near-equal runs only (GB) "
           "| nested regroup (GB) | across domains (GB) "
           "| uniform DP all-reduce across domains (GB) |", "|---|---|---|---|---|---|---|"]
  zero_lines = ["", "Per core device and step, across domains, by optimizer state (GB; "
                "`/ replicated`: the total over the replicated all-reduce's). With the "
                "parameters gathered in the gradients' dtype ZeRO-1's three collectives add up "
                "to the ring all-reduce for any k: (P-1)/P + 2 (C-1)/C / P + (P-1)/P = "
                "2 (R-1)/R, as R = P C. ZeRO-2 sends the first two once per micro-batch "
                f"(m = {args.microbatches}).", "",
                "| TP degrees | R | L (M elements) | optimizer state | P pieces | C copies "
                "| reduce-scatter | all-reduce | all-gather | total | / replicated |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, tp, dp, failed in progress(MIXES, "mixes"):
    model = cfg
    if tp > 8:  # a 72-slot domain: finer MLP units so every slot holds some columns
      model = dataclasses.replace(cfg, ffn_granularity=64)
    plan = make_plan(functools.partial(model_layouts, model), tp=tp, dp=dp,
                     failed=parse_failed(failed, dp, tp),
                     batch_size=dp)
    states = [abstract_params(lambda c=c, model=model: GPT(model, c.layouts, rngs=nnx.Rngs(0)))
              for c in plan.classes]
    traffic = sync_traffic(plan, states, itemsize)
    equal_runs = sync_traffic(plan, states, itemsize, regroups={})
    live = len(plan.replicas)
    g = traffic["logical"]
    nested = sum(2 * (r.degree - plan.t_min) / r.degree * g for r in plan.replicas)
    uniform = 2 * (live - 1) / live * g * live
    lines.append(f"| {name} | {g / 1e9:.2f} | {traffic['intra_domain'] / 1e9:.2f} "
                 f"| {equal_runs['intra_domain'] / 1e9:.2f} | {nested / 1e9:.2f} "
                 f"| {traffic['cross_replica'] / 1e9:.2f} | {uniform / 1e9:.2f} |")
    zero_lines += zero_rows(name, plan, states, itemsize, args.microbatches)
  emit(lines + zero_lines, args.out)


def zero_rows(name, plan, states, itemsize, microbatches) -> list[str]:
  """Markdown rows: bytes one core device sends across domains per step, replicated and
  ZeRO-1 and ZeRO-2 (``microbatches`` a step) with one and two copies (the formulas in the
  module docstring)."""
  t_min, live = plan.t_min, len(plan.replicas)
  regroups = plan_regroups(plan, states)
  leaves = sync_leaves(states[0], plan.classes[0].degree, t_min, regroups)
  length = sum(leaf.position_size for leaf in leaves) + 1  # the loss element
  buffer = length * itemsize
  replicated = 2 * (live - 1) / live * buffer
  rows = [("replicated", "-", "-", 0.0, replicated, 0.0)]
  for copies in (1, 2)[:live]:
    pieces = piece_count(live, copies)
    held = live // pieces
    scatter = (pieces - 1) / pieces * buffer
    reduce = 2 * (held - 1) / held * buffer / pieces
    rows.append((f"zero1 k={copies}", pieces, held, scatter, reduce, scatter))
    rows.append((f"zero2 k={copies}, m={microbatches}", pieces, held, microbatches * scatter,
                 microbatches * reduce, scatter))
  out = []
  for choice, pieces, held, scatter, reduce, gather in rows:
    total = scatter + reduce + gather
    out.append(f"| {name} | {live} | {length / 1e6:.1f} | {choice} | {pieces} | {held} "
               f"| {scatter / 1e9:.3f} | {reduce / 1e9:.3f} | {gather / 1e9:.3f} "
               f"| {total / 1e9:.3f} | {total / replicated:.3f} |")
  return out


if __name__ == "__main__":
  main()
