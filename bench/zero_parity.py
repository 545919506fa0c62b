"""Whole runs of each optimizer-state choice against the replicated one: losses and state.

  python bench/zero_parity.py [--mesh 3x4] [--failed 2:3] [--steps 20] [--microbatches 2]

gpt_tiny trains ``--steps`` steps on ``--mesh`` (DP x TP simulated CPU devices) with
``--failed`` slots, once replicated and once per choice (zero1 and zero2, one and two
copies); each run's last step is a logical checkpoint. Printed per choice: the largest
relative difference of a step's loss from the replicated run's, and the largest
difference of a floating-point checkpoint leaf (parameters, Adam moments) over that
leaf's norm. Then the live scenario: replica 2 (the last) loses every slot at step 10,
replica 0 loses slot 1 at step 15 (``ntp.recovery=live``), zero2 with two copies against
the replicated run with the same events: the losses, the live moves and the checkpoint
reads. Minutes on 2 cores; the runs go under ``--workdir``.
"""

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import load_config, simulate_cpu_devices  # noqa: E402

ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ARGS.add_argument("--mesh", default="3x4", help="DP x TP")
ARGS.add_argument("--failed", default="2:3")
ARGS.add_argument("--steps", type=int, default=20)
ARGS.add_argument("--microbatches", type=int, default=2)
ARGS.add_argument("--batch", type=int, default=24)
ARGS.add_argument("--workdir", default="runs/zero_parity")
args = ARGS.parse_args()
DP, TP = (int(n) for n in args.mesh.split("x"))
simulate_cpu_devices(DP * TP)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from ntp_jax.state.checkpoint import Checkpoints  # noqa: E402
from ntp_jax.training.trainer import train  # noqa: E402


def run(name, log=None, every=None, **overrides):
  config = load_config("configs/gpt_tiny.py")
  config.workdir = os.path.join(args.workdir, name)
  config.mesh.dp, config.mesh.tp = DP, TP
  config.train.steps, config.train.batch_size = args.steps, args.batch
  config.train.microbatches = args.microbatches
  config.train.plot, config.train.eval_every = False, 0
  config.data.max_corpus_bytes = 300_000
  config.checkpoint.every = every or args.steps
  for key, value in overrides.items():
    section, field = key.split(".")
    config[section][field] = value
  return train(config, log=log or (lambda *_: None))


def stored(name):
  """``path -> numpy array`` of the last checkpoint's logical arrays, on one device."""
  checkpoints = Checkpoints(os.path.join(args.workdir, name, "checkpoints"), reads_only=True)
  try:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    requests = {path: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
                for path, (shape, dtype) in checkpoints.shapes(args.steps).items()}
    return {path: np.asarray(x) for path, x in checkpoints.restore(args.steps, requests).items()}
  finally:
    checkpoints.close()


def loss_difference(got, want):
  return float(np.max(np.abs(np.subtract(got.losses, want.losses)) / np.abs(want.losses)))


def main():
  shutil.rmtree(args.workdir, ignore_errors=True)
  failed = {"ntp.failed": args.failed}
  base = run("replicated", **failed)
  want = stored("replicated")
  print(f"gpt_tiny, {args.mesh}, failed '{args.failed}', {args.steps} steps of "
        f"{args.microbatches} micro-batches; against the replicated run:")
  for sharding in ("zero1", "zero2"):
    for copies in (1, 2):
      name = f"{sharding}-{copies}"
      result = run(name, **failed, **{"train.optimizer_sharding": sharding,
                                      "train.optimizer_copies": copies})
      got = stored(name)
      leaf = max(np.linalg.norm((got[p] - want[p]).ravel()) / np.linalg.norm(want[p].ravel())
                 for p in want if want[p].dtype.kind == "f" and np.any(want[p]))
      print(f"  {sharding} k={copies}: losses within {loss_difference(result, base):.1e} "
            f"(relative), every state leaf within {leaf:.1e} of its norm", flush=True)
  events = {"ntp.fail_at": f"10@{DP - 1}:" + f",10@{DP - 1}:".join(map(str, range(TP)))
            + ",15@0:1", "ntp.recovery": "live"}
  base = run("live-replicated", every=5, **events)
  lines = []
  result = run("live-zero2", lines.append, every=5, **events, **{
      "train.optimizer_sharding": "zero2", "train.optimizer_copies": 2})
  print(f"live, {events['ntp.fail_at']}: zero2 k=2 losses within "
        f"{loss_difference(result, base):.1e} of the replicated run's; "
        f"{sum('live: state moved' in line for line in lines)} live moves, "
        f"{sum('restor' in line for line in lines)} checkpoint reads")


if __name__ == "__main__":
  main()
