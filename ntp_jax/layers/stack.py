"""Repeated layers with stacked parameters, run by ``jax.lax.scan`` under a remat policy.

``n`` identical layers hold each parameter once, with a layer axis: a
replicated variable is ``[n, ...]``; a ``TPParam`` keeps its slot axis first
and is ``[degree, n, ...]`` (logical ``[n, ...]``, ``tp_axis`` one higher,
``layers`` metadata ``n``), so placement and checkpoints treat it as any other
split parameter, and the gradient sync lays it out layer by layer
(``sync_leaf.SplitSync``: no index past one layer's block). Running the stack
under ``jax.lax.scan`` compiles the layer once: compile time and program size
do not grow with depth.

XLA's cost analysis counts a loop body once, so flop counts come from the
unrolled form (``scan=False``), which runs the same parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from ntp_jax.layers.params import TPParam
from ntp_jax.layers.remat_scan import remat_scan

# ``model.remat`` names -> what the backward pass keeps of each layer (``jax.checkpoint_policies``).
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,  # no rematerialisation: every intermediate kept
    "full": jax.checkpoint_policies.nothing_saveable,  # only the layer's input; all recomputed
    "dots_saveable": jax.checkpoint_policies.dots_saveable,  # matmul outputs kept
    "dots_with_no_batch_dims_saveable":
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # weight matmuls kept
}


def check_remat(name: str, field: str = "remat") -> None:
  """Raises ValueError naming ``field`` when ``name`` is not in ``REMAT_POLICIES``."""
  if name not in REMAT_POLICIES:
    raise ValueError(f"{field}: unknown remat policy {name!r}; choose one of "
                     f"{', '.join(REMAT_POLICIES)}")


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], n: int,
                 rngs: nnx.Rngs) -> nnx.Module:
  """``n`` layers built by ``make_layer(rngs)`` as one module with stacked parameters.

  Each layer draws its own parameters (the rngs are split ``n`` ways), so
  the values do not depend on the layout, as for a single layer.

  Returns:
    A module of ``make_layer``'s type whose variables carry the layer axis
    (see the module docstring); call it only through ``run_layers``.
  """
  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return make_layer(rngs)

  layers = create(rngs)
  for _, v in nnx.iter_graph(layers):
    if isinstance(v, TPParam):  # slot axis back in front of the layer axis
      v.set_value(jnp.moveaxis(v.get_value(), 0, 1))
      v.set_metadata(tp_axis=v.tp_axis + 1, layers=n)
  return layers


def layer_states(layers: nnx.Module) -> tuple[nnx.GraphDef, nnx.State]:
  """``(graphdef, state)`` of a ``stack_layers`` module with the layer axis first everywhere.

  Call inside a ``shard_map`` body. A ``TPParam``'s local ``[1, n, ...]`` becomes
  ``[n, 1, ...]`` (replicated variables are ``[n, ...]`` already), so ``jax.lax.scan``
  over the state, or indexing it, yields one layer's local view: merge it with
  ``graphdef`` to call that layer.
  """
  graphdef, state = nnx.split(layers)
  # The local slot axis has length one, so a reshape does it: a bitcast, where moving the
  # axis would lay every block out again (and its gradient back) in each step.
  def layer_first(v):
    if not isinstance(v, TPParam):
      return v
    value = v.get_value()
    return v.replace(value.reshape(value.shape[1], 1, *value.shape[2:]))

  return graphdef, jax.tree.map(layer_first, state, is_leaf=_is_variable)


def run_layers(layers: nnx.Module, x: jax.Array, *args, scan: bool = True,
               remat: str = "none") -> jax.Array:
  """``x = layer(x, *args)`` for each layer of a ``stack_layers`` module, in order.

  Call inside a ``shard_map`` body (local view: ``TPParam`` values
  ``[1, n, ...]``).

  Args:
    layers: the stacked module.
    x: the carried activation (same shape and dtype in and out).
    args: passed unchanged to every layer (e.g. RoPE tables). With ``scan`` and
      ``remat="full"`` they are constants (no gradient flows to them).
    scan: ``jax.lax.scan`` over the layer axis; False unrolls a Python loop.
    remat: a ``REMAT_POLICIES`` name, applied per layer with ``jax.checkpoint``;
      ``"full"`` with ``scan`` runs ``remat_scan`` (the same values and gradients, without
      the float32 copies of bfloat16 stacks that XLA's CPU compiler otherwise keeps).

  Raises:
    ValueError: unknown ``remat``.
  """
  check_remat(remat)
  graphdef, per_layer = layer_states(layers)

  def apply(x, layer_state, *args):
    return nnx.merge(graphdef, layer_state)(x, *args)

  if scan and remat == "full":  # the same values; no float32 twins of the stacks on CPU
    return remat_scan(apply, x, per_layer, args)
  policy = REMAT_POLICIES[remat]
  if remat != "none":
    apply = jax.checkpoint(apply, policy=policy, prevent_cse=not scan)
  if scan:
    return jax.lax.scan(lambda h, s: (apply(h, s, *args), None), x, per_layer)[0]
  n = jax.tree.leaves(per_layer)[0].shape[0]
  # One split per parameter (its transpose is one concatenate), not n slices whose
  # transposes would each add a full-size zero-padded gradient.
  pieces = jax.tree.map(lambda a: jnp.split(a, n, axis=0), per_layer)
  for i in range(n):
    layer = jax.tree.map(lambda p, i=i: p[i][0], pieces, is_leaf=lambda p: isinstance(p, list))
    x = apply(x, layer, *args)
  return x
