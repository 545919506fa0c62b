"""Losses and final logical state of gpt_tiny runs, dumped to compare two commits.

  XLA_FLAGS=--xla_force_host_platform_device_count=12 python bench/parity_dump.py OUT_DIR [NAME ...]
  python bench/parity_compare.py NEW_DIR REF_DIR [NAME ...]

20 steps of gpt_tiny on dp=3 tp=4 with replica 2 at TP degree 3 (``ntp.failed=2:3``),
batch 18 in 2 micro-batches, replicated and zero1/zero2 with one and two copies
(``NAME``: ``replicated_k1``, ``zero1_k1``, ...; default all five); ``CLIP`` in the
environment overrides ``train.clip_norm``. Each run's losses and its last step's logical
checkpoint go to ``OUT_DIR/NAME.npz``. The script imports the checkout it sits in: run a
copy of it in a checkout of each commit (``git worktree add``), then compare the folders.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import configs.gpt_tiny  # noqa: E402
from ntp_jax.state.checkpoint import Checkpoints  # noqa: E402
from ntp_jax.training.trainer import train  # noqa: E402

CHOICES = [("replicated", 1), ("zero1", 1), ("zero1", 2), ("zero2", 1), ("zero2", 2)]


def main():
  out = sys.argv[1]
  os.makedirs(out, exist_ok=True)
  only = sys.argv[2:] or None
  for sharding, copies in CHOICES:
    name = f"{sharding}_k{copies}"
    if only and name not in only:
      continue
    c = configs.gpt_tiny.get_config()
    c.workdir = f"{out}/{name}"
    c.train.steps, c.train.log_every, c.train.plot, c.train.eval_every = 20, 1, False, 0
    c.data.max_corpus_bytes = 300_000
    c.mesh.dp, c.mesh.tp, c.ntp.failed = 3, 4, "2:3"
    c.train.batch_size, c.train.microbatches = 18, 2
    c.train.optimizer_sharding, c.train.optimizer_copies = sharding, copies
    c.checkpoint.every = 20
    c.train.clip_norm = float(os.environ.get("CLIP", c.train.clip_norm))
    train(c, log=lambda *_: None)
    with open(f"{c.workdir}/metrics.jsonl") as f:
      rows = [json.loads(line) for line in f if '"loss"' in line]
    losses = np.array([r["loss"] for r in rows if "loss" in r and "step" in r])
    checkpoints = Checkpoints(c.workdir + "/checkpoints", reads_only=True)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    requests = {p: jax.ShapeDtypeStruct(s, d, sharding=one)
                for p, (s, d) in checkpoints.shapes(20).items()}
    state = {"/".join(map(str, p)): np.asarray(x)
             for p, x in checkpoints.restore(20, requests).items()}
    checkpoints.close()
    np.savez(f"{out}/{name}.npz", losses=losses, **{"s:" + k: v for k, v in state.items()})
    print(name, losses[-3:], flush=True)


if __name__ == "__main__":
  main()
