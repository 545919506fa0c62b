"""The packed sequences of several token shards as one read-only array of rows.

Each shard is cut into its own sequences (``packing.cut_into_sequences``: no sequence
spans two shards, each shard's tail too short for one is dropped); ``ShardedRows``
stacks them without copying, so memory-mapped shards stay on disk until a row is read.
It has what ``PackedDataset`` asks of its rows: ``shape``, ``dtype``, a slice of rows
(the train / validation split) and rows gathered by an index array.
"""

from __future__ import annotations

import numpy as np


class ShardedRows:
  """Rows ``[n_0 + n_1 + ..., width]`` over per-shard row arrays ``[n_i, width]``.

  Args:
    parts: each shard's rows (memmaps or arrays), all of one width and dtype.
  """

  def __init__(self, parts: list[np.ndarray]):
    self.parts = [p for p in parts if p.shape[0]]
    self.starts = np.cumsum([0] + [p.shape[0] for p in self.parts])
    width = parts[0].shape[1]
    self.shape = (int(self.starts[-1]), width)
    self.dtype = parts[0].dtype

  def __len__(self) -> int:
    return self.shape[0]

  def __getitem__(self, index):
    """A slice of rows (a ``ShardedRows``, no copy) or rows at an int array (an array)."""
    if isinstance(index, slice):
      start, stop, step = index.indices(self.shape[0])
      if step != 1:
        raise ValueError("ShardedRows takes slices of step 1")
      parts = []
      for part, first in zip(self.parts, self.starts[:-1]):
        lo, hi = max(start - first, 0), min(stop - first, part.shape[0])
        if lo < hi:
          parts.append(part[lo:hi])
      return ShardedRows(parts or [self.parts[0][:0]])
    ids = np.asarray(index, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
      raise IndexError(f"row index out of range for {self.shape[0]} rows")
    out = np.empty((ids.size, self.shape[1]), self.dtype)
    shard = np.searchsorted(self.starts, ids, side="right") - 1
    for s in np.unique(shard):
      rows = shard == s
      out[rows] = self.parts[s][ids[rows] - self.starts[s]]
    return out
