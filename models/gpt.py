"""Llama-style decoder built from ``ntp_jax.layers`` (local view, inside ``shard_map``).

Pre-norm blocks of grouped-query attention with RoPE and a SwiGLU MLP,
RMSNorm, vocabulary-parallel embedding and output head (separate, or tied:
the head is the embedding table transposed); the loss is
the vocabulary-parallel cross-entropy, so full logits never exist on one
device. Shapes follow Llama 3 (Grattafiori et al., arXiv:2407.21783, Table 3).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from ntp_jax.errors import ConfigError
from ntp_jax.interop import hf_llama
from ntp_jax.layers import (
  REMAT_POLICIES,
  Attention,
  ColumnParallelLinear,
  RMSNorm,
  SwiGLU,
  VocabParallelEmbed,
  rope_angles,
  run_layers,
  stack_layers,
  vocab_parallel_cross_entropy,
)
from ntp_jax.layers.cached_attention import cache_heads, cached_attention
from ntp_jax.layers.shard import to_logical
from ntp_jax.layers.stack import layer_states
from ntp_jax.model import Decoding, ModelSpec
from ntp_jax.sharding.layout import Layout, make_layout, units_of
from ntp_jax.state.placement import flatten

# Compute and storage dtypes trained here (float16 is not: XLA's CPU dots refuse it, and it
# would need loss scaling).
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
TRAINER_KEYS = ("factory", "init_from")  # ``model.*`` keys the trainer reads, not GPTConfig
HF_PREFIX = "hf:"  # ``model.init_from`` of a local Hugging Face Llama folder


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Model shape; validated on construction (errors name the ``model.`` field)."""

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  d_ff: int
  rope_theta: float = 500_000.0
  norm_eps: float = 1e-5
  ffn_granularity: int = 1  # MLP columns per shard unit
  vocab_granularity: int = 1  # vocabulary rows per shard unit
  dtype: str = "float32"  # compute dtype
  param_dtype: str = "float32"  # storage dtype of parameters
  scan_layers: bool = True  # blocks under jax.lax.scan (False: unrolled, for cost analysis)
  remat: str = "none"  # per-block rematerialisation policy (ntp_jax.layers.REMAT_POLICIES)
  tie_embeddings: bool = False  # output head = embedding table transposed (no ``head`` param)

  def __post_init__(self):
    """Raises ConfigError, one line naming the ``model.`` field."""
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "d_ff", "ffn_granularity", "vocab_granularity"):
      if getattr(self, name) < 1:
        raise ConfigError(f"model.{name}: must be >= 1, got {getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ConfigError(f"model.n_heads: {self.n_heads} is not a multiple of "
                       f"model.n_kv_heads {self.n_kv_heads}")
    if self.head_dim % 2:
      raise ConfigError(f"model.head_dim: RoPE needs an even head_dim, got {self.head_dim}")
    for name, dim_name in (("ffn_granularity", "d_ff"), ("vocab_granularity", "vocab_size")):
      try:
        units_of(getattr(self, dim_name), getattr(self, name))
      except ValueError:
        raise ConfigError(f"model.{name}: {getattr(self, name)} does not divide "
                          f"model.{dim_name} {getattr(self, dim_name)}") from None
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ConfigError(f"model.{name}: {getattr(self, name)!r} is not supported; "
                         f"choose one of {', '.join(_DTYPES)}")
    if self.remat not in REMAT_POLICIES:
      raise ConfigError(f"model.remat: unknown policy {self.remat!r}; choose one of "
                        f"{', '.join(REMAT_POLICIES)}")

  @classmethod
  def from_config(cls, model_cfg, **replace) -> GPTConfig:
    """From the ``model`` section of an ml_collections config (or a dict).

    Unknown keys are rejected; ``factory`` and ``init_from`` are the
    trainer's, not the model's. ``replace`` fields take the place of the
    section's before validation (e.g. the shape of a Hugging Face folder).

    Raises:
      ConfigError: an unknown field or a bad value, naming ``model.<field>``.
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in dict(model_cfg).items() if k not in TRAINER_KEYS}
    extra = (set(given) | set(replace)) - fields
    if extra:
      raise ConfigError(f"model: unknown field(s) {sorted(extra)}")
    return cls(**{**given, **replace})

  @property
  def compute_dtype(self):
    return _DTYPES[self.dtype]

  @property
  def storage_dtype(self):
    return _DTYPES[self.param_dtype]

  def logical_shapes(self) -> dict[tuple[str, ...], tuple[int, ...]]:
    """``path -> logical shape`` of every parameter of ``GPT(self)`` (paths under
    ``params``), from abstract shapes (nothing allocated)."""
    abstract = nnx.state(nnx.eval_shape(
        lambda: GPT(self, model_layouts(self, 1), rngs=nnx.Rngs(0))), nnx.Param)
    logical = jax.eval_shape(to_logical, abstract)
    return {p: tuple(x.shape) for p, x in flatten(logical).items()}


@dataclasses.dataclass(frozen=True)
class ModelLayouts:
  """The three split dimensions of the model for one TP group."""

  heads: Layout  # KV-head groups (unit: one KV head and its query heads)
  ffn: Layout  # MLP columns (unit: ffn_granularity columns)
  vocab: Layout  # vocabulary rows (unit: vocab_granularity rows)

  @property
  def degree(self) -> int:
    return self.heads.degree


def model_layouts(cfg: GPTConfig, tp: int, failed: Sequence[int] = (),
                  weights: Sequence[float] | None = None) -> ModelLayouts:
  """Layouts of attention, MLP and vocabulary over the live slots of one TP group.

  Raises:
    ValueError: naming the ``ntp_jax.sharding.layout`` argument: ``tp`` < 1, invalid
      ``failed`` slots or ``weights`` (``ntp_jax.parallel.plan.make_plan`` checks the
      config's before calling this, and names the field).
  """
  kw = dict(failed=failed, weights=weights)
  return ModelLayouts(
      # Leftover KV groups are shared, each slot computing them on its run of positions:
      # no slot pads a group.
      heads=make_layout(cfg.n_kv_heads, tp, share_remainder=True, **kw),
      ffn=make_layout(cfg.d_ff // cfg.ffn_granularity, tp, unit_size=cfg.ffn_granularity, **kw),
      vocab=make_layout(cfg.vocab_size // cfg.vocab_granularity, tp,
                        unit_size=cfg.vocab_granularity, **kw),
  )


class DecoderBlock(nnx.Module):
  """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

  def __init__(self, cfg: GPTConfig, layouts: ModelLayouts, *, rngs: nnx.Rngs):
    kw = dict(dtype=cfg.compute_dtype, param_dtype=cfg.storage_dtype)
    self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, **kw)
    self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.head_dim, layouts.heads, rngs=rngs, **kw)
    self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, **kw)
    self.mlp = SwiGLU(cfg.d_model, layouts.ffn, rngs=rngs, **kw)

  def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x), cos, sin)
    return x + self.mlp(self.mlp_norm(x))


class GPT(nnx.Module):
  """Llama-style decoder over one TP group's layouts.

  ``__call__`` and ``loss_sum`` run inside a ``shard_map`` body (see
  ``ntp_jax.layers.shard``) and see this device's blocks. The decoder blocks are one
  stacked module (``ntp_jax.layers.stack_layers``): each block parameter has a
  layer axis, e.g. ``blocks.attn.wq`` is logically
  ``[n_layers, d_model, n_heads * head_dim]``. With ``cfg.tie_embeddings``
  there is no ``head``: the logits are ``x @ embed.embedding.T``, each slot's
  vocabulary rows giving its block of the logits (the same vocabulary layout
  a separate head's columns use).
  """

  def __init__(self, cfg: GPTConfig, layouts: ModelLayouts, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.layouts = layouts
    kw = dict(dtype=cfg.compute_dtype, param_dtype=cfg.storage_dtype)
    self.embed = VocabParallelEmbed(layouts.vocab, cfg.d_model, rngs=rngs, **kw)
    self.blocks = stack_layers(lambda r: DecoderBlock(cfg, layouts, rngs=r), cfg.n_layers, rngs)
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, **kw)
    if not cfg.tie_embeddings:
      self.head = ColumnParallelLinear(cfg.d_model, layouts.vocab, rngs=rngs, **kw)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """int ``[batch, seq]`` -> this slot's logits ``[batch, seq, vocab block]``."""
    positions = jnp.arange(tokens.shape[-1])[None, :]
    cos, sin = rope_angles(positions, self.cfg.head_dim, self.cfg.rope_theta)
    x = self.embed(tokens)  # [b, s, d] replicated over the TP group
    x = run_layers(self.blocks, x, cos, sin, scan=self.cfg.scan_layers, remat=self.cfg.remat)
    x = self.final_norm(x)
    return self.embed.attend(x) if self.cfg.tie_embeddings else self.head(x)

  def loss_sum(self, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """f32 scalar: sum of next-token cross-entropy over this device's batch rows."""
    return jnp.sum(vocab_parallel_cross_entropy(self(tokens), targets, self.layouts.vocab))

  # --- decoding with a KV cache (ntp_jax.model.CachedForward) ---------------------------------

  def cache_shapes(self, batch: int, max_len: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The empty KV cache: keys (RoPE applied) and values ``[degree, n_layers, batch,
    max_len, heads, head_dim]`` in the compute dtype, ``heads`` the KV groups of one slot's
    block (``cached_attention.cache_heads``: own and shared). Outside ``shard_map``."""
    shape = (self.layouts.degree, self.cfg.n_layers, batch, max_len,
             cache_heads(self.blocks.attn), self.cfg.head_dim)
    return (jax.ShapeDtypeStruct(shape, self.cfg.compute_dtype),) * 2

  def decode(self, tokens: jax.Array, cache: tuple[jax.Array, jax.Array], offset: jax.Array
             ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Inside ``shard_map``: the vocabulary block of the last new position, the cache updated.

    The embedding, norms, SwiGLU and head are the training layers; only attention reads
    and writes the cache (``ntp_jax.layers.cached_attention``).

    Args:
      tokens: int32 ``[batch, new]``, the tokens at positions ``offset ..``.
      cache: this slot's ``(keys, values)``, each ``[1, n_layers, batch, max_len, heads,
        head_dim]``.
      offset: int32 scalar.

    Returns:
      ``(logits, cache)``: ``logits [batch, vocab block]`` of position ``offset + new - 1``
      (this slot's vocabulary rows, zero in padding), and the cache with the new positions
      written.
    """
    cfg = self.cfg
    k_cache, v_cache = cache
    positions = offset + jnp.arange(tokens.shape[1])[None, :]
    cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope_theta)
    x = self.embed(tokens)  # [b, s, d] replicated over the TP group
    graphdef, per_layer = layer_states(self.blocks)

    def layer(x, xs):
      state, k, v = xs  # k, v: [b, max_len, heads, head_dim]
      block = nnx.merge(graphdef, state)
      attended, k, v = cached_attention(block.attn, block.attn_norm(x), cos, sin, k, v, offset)
      x = x + attended
      return x + block.mlp(block.mlp_norm(x)), (k, v)

    x, (k_cache, v_cache) = jax.lax.scan(layer, x, (per_layer, k_cache[0], v_cache[0]))
    x = self.final_norm(x[:, -1])  # [b, d]
    logits = self.embed.attend(x) if cfg.tie_embeddings else self.head(x)
    return logits, (k_cache[None], v_cache[None])


def count_params(cfg: GPTConfig) -> int:
  """Logical parameter count (no padding), computed from the shapes alone."""
  attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
  mlp = 3 * cfg.d_model * cfg.d_ff
  per_layer = attn + mlp + 2 * cfg.d_model
  tables = 1 if cfg.tie_embeddings else 2  # embedding, and the head unless tied
  return cfg.n_layers * per_layer + tables * cfg.vocab_size * cfg.d_model + cfg.d_model


def gpt_spec(cfg: GPTConfig, seed: int) -> ModelSpec:
  """The library's view of a GPT of ``cfg`` whose parameters are drawn from ``seed``: it
  trains, exports as a Hugging Face Llama folder and decodes (``GPT.decode``)."""
  make = lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(seed))  # noqa: E731
  return ModelSpec(
      layouts=functools.partial(model_layouts, cfg),
      make=make,
      vocab_size=cfg.vocab_size, param_count=count_params(cfg), n_layers=cfg.n_layers,
      unrolled=lambda n: gpt_spec(dataclasses.replace(cfg, n_layers=n, scan_layers=False), seed),
      layers=lambda n: gpt_spec(dataclasses.replace(cfg, n_layers=n), seed),
      name="gpt",
      export_hf=lambda params, folder, **kw: hf_llama.export_hf(params, cfg, folder, **kw),
      decoding=Decoding(make=make, fields=dataclasses.asdict(cfg),
                        describe=lambda layouts: f"KV groups {layouts.heads.describe()}"))


def hf_folder(model_cfg) -> str | None:
  """The folder of ``model.init_from = "hf:FOLDER"``; None for ``""`` (random init).

  Raises:
    ConfigError: naming ``model.init_from``: another scheme, or no such folder.
  """
  init_from = model_cfg.init_from
  if not init_from:
    return None
  if not init_from.startswith(HF_PREFIX):
    raise ConfigError(f"model.init_from: {init_from!r} is not '' (random init) or "
                      f"'{HF_PREFIX}/path/to/folder' (a Hugging Face Llama folder)")
  folder = init_from[len(HF_PREFIX):]
  if not os.path.isdir(folder):
    raise ConfigError(f"model.init_from: {init_from!r}: no folder {folder!r}")
  return folder


def gpt_config(model_cfg) -> GPTConfig:
  """The ``GPTConfig`` of a ``model`` section, ``model.init_from`` applied.

  With ``"hf:FOLDER"`` the folder's ``config.json`` gives the shape
  (``ntp_jax.interop.hf_llama.read_hf_config``: vocabulary, widths, depth, heads,
  ``rope_theta``, ``norm_eps``, ``tie_embeddings``) in place of the
  section's; dtypes, ``remat``, ``scan_layers`` and the granularities stay
  the section's.

  Raises:
    ConfigError: a bad ``model.*`` field or ``model.init_from``, named; an
      unusable ``config.json``, naming the file and key.
  """
  folder = hf_folder(model_cfg)
  if folder is None:
    return GPTConfig.from_config(model_cfg)
  return GPTConfig.from_config(model_cfg, **hf_llama.read_hf_config(folder))


def model_spec(config) -> ModelSpec:
  """``model.factory`` of the GPT: the ``model`` section and ``train.seed`` of ``config``.

  With ``model.init_from = "hf:FOLDER"`` (see ``gpt_config``) a fresh run
  starts from the folder's weights (``initial_source``: an ``HFSource``,
  whose tensor names and shapes are checked here from the headers), the
  text is encoded with the folder's ``tokenizer.json`` when it has one
  (``tokenizer_file``; without one a BPE is trained as usual), and
  generation decodes up to the folder's ``max_position_embeddings``
  (``decoding.max_len``). Generation from a folder (``python -m
  ntp_jax.generate --from hf:FOLDER``) calls this with a config of only
  ``model.factory``, ``model.init_from`` and its ``--config.model.*``
  overrides, and ``train.seed``: every other ``GPTConfig`` field takes its default.

  Raises:
    ConfigError: a bad ``model.*`` field or ``model.init_from``, named; a
      folder whose ``config.json`` or tensors do not fit (naming the file).
  """
  cfg = gpt_config(config.model)
  spec = gpt_spec(cfg, config.train.seed)
  folder = hf_folder(config.model)
  if folder is None:
    return spec
  source = hf_llama.HFSource(folder, cfg)  # checks tensor names and shapes now, reads nothing
  max_len, max_len_field = hf_llama.max_positions(folder)
  return dataclasses.replace(
      spec, initial_source=lambda: source, tokenizer_file=hf_llama.tokenizer_file(folder),
      decoding=dataclasses.replace(spec.decoding, max_len=max_len, max_len_field=max_len_field))
