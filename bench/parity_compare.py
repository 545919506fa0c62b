"""Compare two folders of ``bench/parity_dump.py``: per run, the largest relative loss
difference, the largest state leaf difference over that leaf's norm, and whether every
array is bit-identical.

  python bench/parity_compare.py NEW_DIR REF_DIR [NAME ...]
"""

import sys

import numpy as np

NAMES = ["replicated_k1", "zero1_k1", "zero1_k2", "zero2_k1", "zero2_k2"]


def main():
  new, ref = sys.argv[1], sys.argv[2]
  for name in sys.argv[3:] or NAMES:
    a, b = np.load(f"{ref}/{name}.npz"), np.load(f"{new}/{name}.npz")
    assert a.files == b.files, name
    worst_loss = np.max(np.abs(a["losses"] - b["losses"]) / np.abs(a["losses"]))
    worst, where, exact = 0.0, "", True
    for k in a.files:
      if k == "losses":
        continue
      x, y = a[k].astype(np.float64), b[k].astype(np.float64)
      exact = exact and np.array_equal(a[k], b[k])
      r = np.linalg.norm((x - y).ravel()) / max(np.linalg.norm(x.ravel()), 1e-30)
      if r > worst:
        worst, where = r, k
    print(f"{name}: {len(a['losses'])} losses, max rel diff {worst_loss:.2e}; state max rel "
          f"(leaf norm) {worst:.2e} ({where}); bitwise equal: {exact}")


if __name__ == "__main__":
  main()
