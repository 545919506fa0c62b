"""Dense single-device references, written independently of ntp_jax.layers.

Every function takes logical (unsharded, unpadded) weights as produced by
``ntp_jax.layers.shard.to_logical`` and uses only jax.numpy.
"""

import jax
import jax.numpy as jnp
import numpy as np


def rmsnorm(x, scale, eps):
  return x / jnp.sqrt(jnp.mean(x ** 2, axis=-1, keepdims=True) + eps) * scale


def rope(x, theta):
  """x: [b, s, h, d]; rotation by complex multiplication on (x[i], x[i + d/2]) pairs."""
  s, d = x.shape[1], x.shape[-1]
  freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
  angle = np.arange(s)[:, None] * freq[None, :]  # [s, d/2]
  rot = jnp.asarray(np.exp(1j * angle))[None, :, None, :]
  z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * rot
  return jnp.concatenate([z.real, z.imag], axis=-1).astype(x.dtype)


def attention(x, p, n_heads, n_kv_heads, head_dim, theta):
  b, s, _ = x.shape
  q = (x @ p["wq"]).reshape(b, s, n_heads, head_dim)
  k = (x @ p["wk"]).reshape(b, s, n_kv_heads, head_dim)
  v = (x @ p["wv"]).reshape(b, s, n_kv_heads, head_dim)
  q, k = rope(q, theta), rope(k, theta)
  repeat = n_heads // n_kv_heads
  k, v = jnp.repeat(k, repeat, axis=2), jnp.repeat(v, repeat, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
  causal = np.tril(np.ones((s, s), bool))
  scores = jnp.where(causal, scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, n_heads * head_dim)
  return out @ p["wo"]


def swiglu(x, p):
  return (jax.nn.silu(x @ p["gate"]["kernel"]) * (x @ p["up"]["kernel"])) @ p["down"]["kernel"]


def cross_entropy(logits, labels):
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


def gpt_logits(p, tokens, cfg):
  x = p["embed"]["embedding"][tokens]
  for i in range(cfg.n_layers):
    blk = jax.tree.map(lambda a, i=i: a[i], p["blocks"])  # stacked: layer axis first
    h = rmsnorm(x, blk["attn_norm"]["scale"], cfg.norm_eps)
    x = x + attention(h, blk["attn"], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta)
    h = rmsnorm(x, blk["mlp_norm"]["scale"], cfg.norm_eps)
    x = x + swiglu(h, blk["mlp"])
  x = rmsnorm(x, p["final_norm"]["scale"], cfg.norm_eps)
  # Tied embeddings: no head, the logits read the embedding table transposed.
  head = p["head"]["kernel"] if "head" in p else p["embed"]["embedding"].T
  return x @ head


def gpt_loss(p, tokens, targets, cfg):
  """Mean next-token cross-entropy over all tokens."""
  return jnp.mean(cross_entropy(gpt_logits(p, tokens, cfg), targets))


# Compiled once per shape (and kept in the run's compilation cache): op-by-op, one model's
# value and gradient took 14 s on 2 CPU cores, compiled 3 s, each later call milliseconds.
gpt_loss_and_grad = jax.jit(jax.value_and_grad(gpt_loss), static_argnums=3)
