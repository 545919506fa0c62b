"""One replica class's training step: loss, gradients and the optimizer update.

A class program runs over a mesh ``('dp', 'tp')`` (see ``ntp_jax.mesh``):
the batch is split over ``'dp'``, parameter blocks over ``'tp'``. The loss is
the sum of per-token cross-entropy over the class's tokens divided by the
*global* token count of the step, so the losses and gradients of several
classes add up to the uniform step over all their samples.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.mesh import DP
from ntp_jax.shard import state_shardings, tp_function

LossGrad = Callable[[nnx.State, jax.Array], tuple[jax.Array, nnx.State]]


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sequences split over ``'dp'``, replicated over ``'tp'``."""
  return NamedSharding(mesh, P(DP))


def make_loss_and_grad(graphdef: nnx.GraphDef, state: nnx.State, mesh: Mesh,
                       global_tokens: int) -> LossGrad:
  """``f(params, batch) -> (loss, grads)`` for one class.

  Args:
    graphdef, state: the model (``GPT``-like: it has ``loss_sum(tokens,
      targets)``) split by ``nnx.split``; ``state`` gives the specs.
    mesh: the class mesh.
    global_tokens: predicted tokens in the whole step, over every class.

  The returned function takes ``batch: int32 [sequences, seq_len + 1]``
  (inputs and shifted targets) and returns the class's share of the mean
  loss (f32 scalar) and its gradient (same structure and sharding as
  ``params``, summed over the class's replicas).
  """
  def local_loss(model, batch):
    # batch: int32 [local sequences, seq + 1]
    loss_sum = model.loss_sum(batch[:, :-1], batch[:, 1:])
    return jax.lax.psum(loss_sum, DP) / global_tokens

  loss_fn = tp_function(graphdef, state, local_loss, mesh, (P(DP),), P())
  return jax.value_and_grad(loss_fn)


def make_train_step(graphdef: nnx.GraphDef, state: nnx.State, mesh: Mesh,
                    optimizer: optax.GradientTransformation, global_tokens: int):
  """Jitted ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` for one class.

  ``metrics`` holds ``loss`` (f32, mean over the step's tokens) and
  ``grad_norm`` (global L2 norm of the logical gradient; padding is zero
  and replicated parameters count once). Parameters and optimizer state are
  donated.
  """
  loss_and_grad = make_loss_and_grad(graphdef, state, mesh, global_tokens)
  param_shardings = state_shardings(state, mesh)

  def step(params, opt_state, batch):
    loss, grads = loss_and_grad(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

  return jax.jit(step, donate_argnums=(0, 1),
                 in_shardings=(param_shardings, None, batch_sharding(mesh)),
                 out_shardings=(param_shardings, None, None))


def init_params(make_model: Callable[[], nnx.Module], mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State]:
  """Build a model's parameters directly in their sharded layout on ``mesh``.

  ``make_model()`` is traced under ``jit`` with the output shardings of the
  padded blocks, so no device holds another slot's blocks.
  """
  abstract = nnx.eval_shape(make_model)
  graphdef, abstract_state = nnx.split(abstract)
  shardings = state_shardings(abstract_state, mesh)
  state = jax.jit(lambda: nnx.split(make_model())[1], out_shardings=shardings)()
  return graphdef, state


def abstract_params(make_model: Callable[[], nnx.Module]) -> nnx.State:
  """Shapes and dtypes of the parameters, allocating nothing (``jax.eval_shape``)."""
  return nnx.split(nnx.eval_shape(make_model))[1]


def tree_bytes(state: nnx.State) -> int:
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
