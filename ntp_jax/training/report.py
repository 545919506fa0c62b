"""Start-up report: every parameter's logical shape and how its TP split is laid out."""

from __future__ import annotations

import re

import numpy as np
from flax import nnx

from ntp_jax.layers.params import TPParam


def parameter_table(state: nnx.State) -> str:
  """One row per parameter (repeated decoder blocks folded as ``blocks.*``).

  Columns: name, logical shape, split axis, per-slot sizes along it (in
  live-slot order), padded block shape per device.
  """
  rows, seen = [], set()
  total = 0
  for path, v in nnx.to_flat_state(state):
    name = ".".join(str(p) for p in path)
    folded = re.sub(r"blocks\.\d+\.", "blocks.*.", name)
    value = v.get_value()
    if isinstance(v, TPParam):
      layout, axis = v.tp_layout, v.tp_axis
      logical = list(value.shape[1:])
      logical[axis] = layout.size
      split = f"axis {axis}: " + ",".join(str(s) for s in layout.sizes)
      if layout.shared_units:
        split += f" +{layout.shared_units * layout.unit_size} shared"
      block = tuple(value.shape[1:])
    else:
      logical, split, block = list(value.shape), "replicated", tuple(value.shape)
    total += int(np.prod(logical))
    if folded in seen:
      continue
    seen.add(folded)
    rows.append((folded, str(tuple(logical)), split, str(block)))
  header = ("parameter", "logical shape", "per-slot sizes", "block per device")
  widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
  widths[2] = min(widths[2], 60)
  fmt = "  ".join(f"{{:<{w}}}" for w in widths)
  lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
  for r in rows:
    split = r[2] if len(r[2]) <= 60 else r[2][:57] + "..."
    lines.append(fmt.format(r[0], r[1], split, r[3]))
  lines.append(f"logical parameters: {total:,}")
  return "\n".join(lines)

