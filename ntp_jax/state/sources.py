"""Sources of logical state for ``placement.place_logical``: fresh parameters, host arrays.

Checkpoints (``checkpoint.CheckpointSource``) and live DP peers
(``peer.PeerSource``) are the other sources.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from ntp_jax.layers.params import TPParam
from ntp_jax.state.placement import BaseSource, Path, is_variable, key_name


class ArraySource(BaseSource):
  """Logical arrays held by the host (numpy), e.g. imported weights or test data.

  ``device_put`` sends each device only its piece of the requested sharding.
  """

  def __init__(self, arrays: dict[Path, Any]):
    self.arrays = arrays

  def paths(self) -> set[Path]:
    return set(self.arrays)

  def read(self, requests: dict[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.Array]:
    """Raises ValueError naming the first array whose shape differs from the request."""
    for path, request in requests.items():
      shape = tuple(np.shape(self.arrays[path]))
      if shape != tuple(request.shape):
        raise ValueError(f"{'/'.join(path)}: shape {shape}, expected {tuple(request.shape)}")
    return {p: jax.device_put(np.asarray(self.arrays[p], r.dtype), r.sharding)
            for p, r in requests.items()}


class InitSource(BaseSource):
  """Fresh parameters: the model built at TP degree 1 gives the logical arrays.

  Every layout draws its parameters as logical arrays first
  (``layers.params.tp_param``), so the degree-1 model of the same seed holds
  exactly the values any plan starts from. The initialiser runs under
  ``jax.jit`` with the requested shardings as outputs, once per set of
  devices; it fills ``params`` only (optimizer state starts from
  ``optimizer.init``).

  Args:
    make_logical_model: builds the model over one slot (degree-1 layouts).
  """

  def __init__(self, make_logical_model: Callable[[], nnx.Module]):
    self.make_logical_model = make_logical_model
    abstract = nnx.state(nnx.eval_shape(make_logical_model), nnx.Param)
    self._paths = {("params",) + tuple(key_name(k) for k in path)
                   for path, _ in jax.tree_util.tree_flatten_with_path(
                       abstract, is_leaf=is_variable)[0]}

  def paths(self) -> set[Path]:
    return self._paths

  def read(self, requests: dict[Path, jax.ShapeDtypeStruct]) -> dict[Path, jax.Array]:
    groups: dict[Any, list[Path]] = {}
    for path, request in requests.items():
      groups.setdefault(frozenset(request.sharding.device_set), []).append(path)
    out = {}
    for paths in groups.values():
      def logical(paths=paths):
        state = nnx.state(self.make_logical_model(), nnx.Param)
        flat = {("params",) + tuple(key_name(k) for k in path): node
                for path, node in jax.tree_util.tree_flatten_with_path(
                    state, is_leaf=is_variable)[0]}
        # TPParam blocks of a degree-1 layout are [1, *logical]: drop the slot axis.
        return {p: flat[p].get_value()[0] if isinstance(flat[p], TPParam)
                else flat[p].get_value() for p in paths}
      out.update(jax.jit(logical, out_shardings={p: requests[p].sharding for p in paths})())
    return out
