"""The same Llama-style GPT as ``models/gpt.py``, written as plain JAX for XLA's GSPMD.

The reference a user would pick instead of ntp_jax: parameters are global
arrays with a ``NamedSharding`` over a ``('dp', 'tp')`` mesh (heads, MLP
columns and vocabulary split over ``'tp'``, as Megatron-LM and MaxText do),
the step is one ``jax.jit``, and XLA's SPMD partitioner inserts the
collectives. Nothing here imports ntp_jax's layers: the benchmark compares two
independent implementations of one model (pre-norm blocks, GQA with RoPE,
SwiGLU, RMSNorm, untied head, AdamW with a warmup-cosine schedule, global-norm
clipping, the loss normalised by the step's tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

TP = "tp"


def param_specs() -> dict:
  """``PartitionSpec`` of each parameter (layer-stacked blocks lead with the layer axis)."""
  col, row = P(None, None, TP), P(None, TP, None)
  return {
      "embed": P(TP, None),
      "blocks": {"attn_norm": P(), "wq": col, "wk": col, "wv": col, "wo": row,
                 "mlp_norm": P(), "gate": col, "up": col, "down": row},
      "final_norm": P(),
      "head": P(None, TP),
  }


def param_shardings(mesh: Mesh) -> dict:
  """``NamedSharding`` of each parameter over ``mesh`` (``param_specs``)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(),
                      is_leaf=lambda x: isinstance(x, P))


def init_params(cfg, key: jax.Array) -> dict:
  """f32 parameters of ``cfg`` (a ``models.gpt.GPTConfig``), normal(0.02) kernels."""
  d, hd, L = cfg.d_model, cfg.head_dim, cfg.n_layers
  shapes = {"wq": (L, d, cfg.n_heads * hd), "wk": (L, d, cfg.n_kv_heads * hd),
            "wv": (L, d, cfg.n_kv_heads * hd), "wo": (L, cfg.n_heads * hd, d),
            "gate": (L, d, cfg.d_ff), "up": (L, d, cfg.d_ff), "down": (L, cfg.d_ff, d)}
  keys = iter(jax.random.split(key, len(shapes) + 2))
  normal = lambda shape: 0.02 * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
  blocks = {name: normal(shape) for name, shape in shapes.items()}
  blocks["attn_norm"] = jnp.ones((L, d), jnp.float32)
  blocks["mlp_norm"] = jnp.ones((L, d), jnp.float32)
  return {"embed": normal((cfg.vocab_size, d)), "blocks": blocks,
          "final_norm": jnp.ones((d,), jnp.float32), "head": normal((d, cfg.vocab_size))}


def _rms_norm(x, scale, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, positions, theta):
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
  angle = positions[:, None] * freq  # [seq, half]
  cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]
  a, b = x[..., :half], x[..., half:]
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def make_loss(cfg, mesh: Mesh, global_tokens: int, scan: bool = True):
  """``loss(params, batch) -> f32``: mean next-token cross-entropy of int32 ``[b, seq + 1]``."""
  heads = NamedSharding(mesh, P(None, None, TP, None))
  vocab = NamedSharding(mesh, P(None, None, TP))

  def block(x, p, positions):
    b, s, _ = x.shape
    h = _rms_norm(x, p["attn_norm"], cfg.norm_eps)
    q = jax.lax.with_sharding_constraint(
        (h @ p["wq"]).reshape(b, s, cfg.n_heads, cfg.head_dim), heads)
    k = jax.lax.with_sharding_constraint(
        (h @ p["wk"]).reshape(b, s, cfg.n_kv_heads, cfg.head_dim), heads)
    v = jax.lax.with_sharding_constraint(
        (h @ p["wv"]).reshape(b, s, cfg.n_kv_heads, cfg.head_dim), heads)
    q, k = _rope(q, positions, cfg.rope_theta), _rope(k, positions, cfg.rope_theta)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, -1)
    x = x + o @ p["wo"]
    h = _rms_norm(x, p["mlp_norm"], cfg.norm_eps)
    return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]

  def loss(params, batch):
    tokens, targets = batch[:, :-1], batch[:, 1:]
    positions = jnp.arange(tokens.shape[1], dtype=jnp.float32)
    x = params["embed"][tokens]
    if scan:
      x = jax.lax.scan(lambda h, p: (block(h, p, positions), None), x, params["blocks"])[0]
    else:
      for i in range(cfg.n_layers):
        x = block(x, jax.tree.map(lambda a, i=i: a[i], params["blocks"]), positions)
    x = _rms_norm(x, params["final_norm"], cfg.norm_eps)
    logits = jax.lax.with_sharding_constraint(x @ params["head"], vocab)
    # One-hot label pick: partitions over the vocabulary split (no gather of the logits).
    label_logit = jnp.sum(logits * jax.nn.one_hot(targets, cfg.vocab_size, dtype=logits.dtype),
                          axis=-1)
    return jnp.sum(jax.nn.logsumexp(logits, axis=-1) - label_logit) / global_tokens

  return loss


def make_optimizer(train) -> optax.GradientTransformation:
  """Global-norm clip, then AdamW (warmup-cosine; decay on kernels and tables, not norm
  scales), from the ``train`` config section."""
  warmup = min(train.warmup_steps, train.steps)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, train.lr, warmup, max(train.steps, warmup + 1), train.lr * train.min_lr_ratio)

  def decayed(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "norm" not in jax.tree_util.keystr(path), params)

  return optax.chain(optax.clip_by_global_norm(train.clip_norm),
                     optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=1e-8,
                                 weight_decay=train.weight_decay, mask=decayed))


def init_state(cfg, train, mesh: Mesh, seed: int = 0) -> tuple[dict, optax.OptState]:
  """Parameters placed in their shardings, and the optimizer state ``jax.jit`` gives them
  (Adam moments follow their parameters)."""
  params = jax.jit(lambda key: init_params(cfg, key), out_shardings=param_shardings(mesh))(
      jax.random.key(seed))
  return params, init_optimizer(train, params, mesh)


def init_optimizer(train, params: dict, mesh: Mesh) -> optax.OptState:
  """The optimizer state of ``params``: moments in their parameter's sharding, scalars
  (step counts) replicated over ``mesh``."""
  optimizer = make_optimizer(train)
  replicated = NamedSharding(mesh, P())
  shardings = optax.tree_map_params(
      optimizer, lambda _, param: param.sharding, jax.eval_shape(optimizer.init, params), params,
      transform_non_params=lambda _: replicated)
  return jax.jit(optimizer.init, out_shardings=shardings)(params)


def make_step(cfg, train, mesh: Mesh, global_tokens: int, params, opt_state,
              scan: bool = True):
  """Jitted ``step(params, opt_state, batch) -> (params, opt_state, loss)``, state donated,
  for the shardings of ``params`` and ``opt_state``; ``batch`` int32 ``[b, seq + 1]``,
  replicated."""
  optimizer = make_optimizer(train)
  loss_fn = make_loss(cfg, mesh, global_tokens, scan)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
  replicated = NamedSharding(mesh, P())
  return jax.jit(step, donate_argnums=(0, 1), in_shardings=(*shardings, replicated),
                 out_shardings=(*shardings, replicated))
