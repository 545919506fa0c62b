"""Times a 10,000-placement loss sweep of the paper's 32K-GPU setup.

Run pinned to two cores, as the acceptance criterion states::

  taskset -c 0,1 python bench/sim_timing.py

Exits with status 1 if the sweep takes a minute or more.
"""

import sys
import time

from ntp_jax.sim import ClusterSpec, PolicySettings, loss_sweep

LIMIT_SECONDS = 60.0


def main() -> int:
  spec = ClusterSpec(num_gpus=32_768, tp=32, pp=8)
  fractions = [i * 5e-4 for i in range(9)]  # 0 .. 4e-3
  start = time.perf_counter()
  points = loss_sweep(spec, fractions, PolicySettings(), num_samples=10_000, seed=0)
  elapsed = time.perf_counter() - start
  worst = {p.policy: p.max_loss for p in points if p.fraction == points[-1].fraction}
  print(f"{len(fractions)} fractions x 10,000 placements x 3 policies at {spec.num_gpus} GPUs: "
        f"{elapsed:.2f} s (limit {LIMIT_SECONDS:.0f} s)")
  print("max loss at the last fraction: "
        + ", ".join(f"{k} {100 * v:.2f}%" for k, v in worst.items()))
  return 0 if elapsed < LIMIT_SECONDS else 1


if __name__ == "__main__":
  sys.exit(main())
