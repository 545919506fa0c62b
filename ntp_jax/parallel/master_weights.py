"""Float32 master weights for parameters stored in a lower precision (bfloat16).

``with_master_weights(inner)`` wraps an optax optimizer. Where every
floating parameter is float32 it is ``inner`` itself (the same state, so
checkpoints of float32 runs are unchanged). Otherwise its state is a
``MasterWeightsState``: a float32 copy of the parameters (``master``) and
``inner``'s state over that copy (Adam's moments then float32 too). Each
update steps the master weights in float32 and gives the parameters their
value rounded to the parameters' dtype, so nothing of a step is lost to
rounding and the state a checkpoint or a live move carries is the whole
optimizer's (``zero.ShardedOptimizer`` keeps the same float32 master weights
in its pieces and reads them from, and writes them back to, this state).
Source: Micikevicius et al., Mixed Precision Training (arXiv:1710.03740),
Sec. 3.1 (an fp32 master copy of the weights).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

MASTER = "master"  # the field of ``MasterWeightsState`` holding the float32 copy


class MasterWeightsState(NamedTuple):
  """``master``: the parameters in float32 (the parameters' tree); ``inner``: the wrapped
  optimizer's state over ``master``."""

  master: Any
  inner: Any


def needs_master(params: Any) -> bool:
  """Whether some floating leaf of ``params`` is stored in less than float32."""
  return any(jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype) != jnp.float32
             for x in jax.tree.leaves(params))


def _float32(tree: Any) -> Any:
  return jax.tree.map(lambda x: x.astype(jnp.float32)
                      if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def with_master_weights(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``inner`` run on float32 master weights where the parameters are stored in less.

  ``update(grads, state, params)`` needs ``params`` (the stored parameters, any floating
  dtype; ``grads`` in their shapes). Its updates are float32: ``round(master) - params``,
  which ``optax.apply_updates`` adds in float32 (a bfloat16 value plus a float32 one), so
  the new parameters are the new master weights rounded to their dtype (exactly, unless a
  parameter changes by more than 2**16 of itself in one step).

  Raises:
    ValueError: from ``update``, ``params`` not given with a ``MasterWeightsState``.
  """

  def init(params):
    if not needs_master(params):
      return inner.init(params)
    master = _float32(params)
    return MasterWeightsState(master, inner.init(master))

  def update(grads, state, params=None):
    if not isinstance(state, MasterWeightsState):
      return inner.update(grads, state, params)
    if params is None:
      raise ValueError("float32 master weights: update needs the stored parameters")
    updates, inner_state = inner.update(_float32(grads), state.inner, state.master)
    master = optax.apply_updates(state.master, updates)
    steps = jax.tree.map(lambda m, p: m.astype(p.dtype).astype(jnp.float32)
                         - p.astype(jnp.float32), master, params)
    return steps, MasterWeightsState(master, inner_state)

  return optax.GradientTransformation(init, update)
