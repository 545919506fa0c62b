"""Text generation (ntp_jax.generate): KV-cache decoding on uneven plans against a dense
numpy model, the no-cache forward, seeded sampling, and the command end to end.

The model is a random Llama with weights of unit scale (embeddings N(0, 1), projections
N(0, 1/fan_in), a head three times that) so that greedy decoding does not collapse onto
one token; 8 KV heads on degree 7 (mesh.tp=8, slot 3 failed) give a shared KV group, the
vocabulary 300 and d_ff 44 split unevenly.
"""

import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, process_env
from jax.sharding import PartitionSpec as P
from layer_check import global_to_logical

from models.gpt import GPTConfig
from ntp_jax.data.tokenizer import train_bpe_tokenizer
from ntp_jax.generate.cli import main
from ntp_jax.generate.decoder import Decoder
from ntp_jax.generate.origin import open_origin, place
from ntp_jax.generate.prompt import PromptCodec
from ntp_jax.generate.sampling import Sampling
from ntp_jax.interop.hf_llama import export_hf, logical_shapes
from ntp_jax.layers.shard import tp_call
from ntp_jax.sharding.mesh import TP

CFG = GPTConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=8,
                d_ff=44, rope_theta=10_000.0)
MAX_LEN = 48  # the folder's max_position_embeddings
PROMPT = np.array([[5, 17, 42, 99, 3, 250]], np.int32)
# The tokenizer's training text: fixed here, so that no edit elsewhere changes the tokens.
_WORDS = ("the plan moves every shard unit of a failed slot to the live slots of its "
          "replica while the others train on at their own degree").split()
TOKENIZER_TEXTS = [" ".join(np.random.default_rng(seed).choice(_WORDS, 400)) + "."
                   for seed in range(8)]
NEW = 16
UNEVEN = (8, (3,))  # mesh.tp=8, slot 3 failed: TP degree 7, one shared KV group


def random_params(cfg, seed=0):
  """Logical float32 parameters of unit scale, by path."""
  rng = np.random.default_rng(seed)
  params = {}
  for path, shape in logical_shapes(cfg).items():
    if path[-1] == "scale":
      value = 1 + 0.1 * rng.standard_normal(shape)
    elif path[0] == "embed":
      value = rng.standard_normal(shape)
    else:
      value = rng.standard_normal(shape) * (3 if path[0] == "head" else 1) / np.sqrt(shape[-2])
    params[path] = value.astype(np.float32)
  return params


# --- dense numpy reference: no cache, no sharding, float64 ------------------------------------


def _rmsnorm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x, theta):
  """x: [s, heads, d]; pairs (i, i + d/2) rotated by position * theta^(-2i/d)."""
  s, _, d = x.shape
  angle = np.arange(s)[:, None] * theta ** (-np.arange(0, d, 2) / d)[None, :]
  cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
  x1, x2 = x[..., :d // 2], x[..., d // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_logits(p, tokens, cfg):
  """f64 ``[s, vocab]`` logits of one sequence: embedding, pre-norm GQA blocks with RoPE,
  SwiGLU, final RMSNorm, head."""
  p = {k: v.astype(np.float64) for k, v in p.items()}
  s, hd, group = len(tokens), cfg.head_dim, cfg.n_heads // cfg.n_kv_heads
  x = p[("embed", "embedding")][tokens]
  for i in range(cfg.n_layers):
    w = {k[1:]: v[i] for k, v in p.items() if k[0] == "blocks"}
    h = _rmsnorm(x, w[("attn_norm", "scale")], cfg.norm_eps)
    q = _rope((h @ w[("attn", "wq")]).reshape(s, cfg.n_heads, hd), cfg.rope_theta)
    k = _rope((h @ w[("attn", "wk")]).reshape(s, cfg.n_kv_heads, hd), cfg.rope_theta)
    v = (h @ w[("attn", "wv")]).reshape(s, cfg.n_kv_heads, hd)
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # head n reads n // group
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x = x + np.einsum("hqk,khd->qhd", probs, v).reshape(s, -1) @ w[("attn", "wo")]
    h = _rmsnorm(x, w[("mlp_norm", "scale")], cfg.norm_eps)
    gate = h @ w[("mlp", "gate", "kernel")]
    x = x + (gate / (1 + np.exp(-gate)) * (h @ w[("mlp", "up", "kernel")])) @ w[
        ("mlp", "down", "kernel")]
  x = _rmsnorm(x, p[("final_norm", "scale")], cfg.norm_eps)
  return x @ p[("head", "kernel")]


def reference_greedy(p, prompt, n, cfg):
  """``n`` greedy tokens, the whole sequence recomputed for each (no cache)."""
  tokens = list(prompt)
  for _ in range(n):
    tokens.append(int(np.argmax(reference_logits(p, np.asarray(tokens), cfg)[-1])))
  return np.asarray(tokens[len(prompt):])


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def params():
  return random_params(CFG)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, params):
  """A Hugging Face folder of the random model, with a byte-level BPE tokenizer.json."""
  out = str(tmp_path_factory.mktemp("hf") / "model")
  export_hf(params, CFG, out, max_position_embeddings=MAX_LEN)
  train_bpe_tokenizer(TOKENIZER_TEXTS, CFG.vocab_size).save(os.path.join(out, "tokenizer.json"))
  return out


@pytest.fixture(scope="module")
def decoders(folder):
  """``(tp, failed, Sampling) -> Decoder``, built once per module."""
  origin = open_origin(f"hf:{folder}", {})
  made = {}

  def get(plan, sampling=Sampling()):
    if (plan, sampling) not in made:
      model, mesh = place(origin, *plan)
      made[(plan, sampling)] = Decoder(model, mesh, sampling)
    return made[(plan, sampling)]

  return get


# --- decoding -----------------------------------------------------------------------------------


def test_greedy_on_degree_7_equals_one_device_and_the_dense_reference(decoders, params):
  uneven = decoders(UNEVEN).generate(PROMPT, NEW).tokens[0]
  one = decoders((1, ())).generate(PROMPT, NEW).tokens[0]
  expected = reference_greedy(params, PROMPT[0], NEW, CFG)
  assert len(set(expected.tolist())) > 4, expected  # not a degenerate continuation
  np.testing.assert_array_equal(uneven, expected)
  np.testing.assert_array_equal(one, expected)
  # Every device holds its own block of the cache: 2 KV groups (1 own + 1 shared) per slot.
  k_cache, _ = decoders(UNEVEN).empty_cache(1, 10)
  assert {s.data.shape for s in k_cache.addressable_shards} == {(1, CFG.n_layers, 1, 10, 2, 8)}
  assert len(k_cache.addressable_shards) == 7


@pytest.mark.parametrize("plan", [UNEVEN, (3, ())], ids=["degree7", "degree3"])
def test_cached_step_logits_equal_the_full_forward(decoders, params, plan):
  decoder = decoders(plan)
  out = decoder.generate(PROMPT, 8, keep_logits=True)
  sequence = np.concatenate([PROMPT, out.tokens[:, :-1]], axis=1)  # what each step read
  model = decoder_model(decoder)
  blocks = tp_call(model, decoder.mesh, jnp.asarray(sequence), out_specs=P(None, None, TP))
  full = np.asarray(global_to_logical(blocks, decoder.vocab))[0, PROMPT.shape[1] - 1:]
  np.testing.assert_allclose(out.logits[:, 0], full, rtol=1e-5, atol=1e-4)
  dense = reference_logits(params, sequence[0], CFG)[PROMPT.shape[1] - 1:]
  np.testing.assert_allclose(out.logits[:, 0], dense, rtol=1e-4, atol=1e-3)
  assert np.abs(dense).max() > 3  # logits of a useful scale


def decoder_model(decoder):
  return nnx.merge(decoder.graphdef, decoder.state)


def test_sampling_is_seeded_and_top_k_1_is_greedy(decoders):
  hot = Sampling(temperature=2.0)
  first = decoders(UNEVEN, hot).generate(PROMPT, NEW, seed=7).tokens
  again = decoders(UNEVEN, hot).generate(PROMPT, NEW, seed=7).tokens
  other = decoders(UNEVEN, hot).generate(PROMPT, NEW, seed=8).tokens
  np.testing.assert_array_equal(first, again)
  assert (first != other).any()
  greedy = decoders((1, ())).generate(PROMPT, NEW).tokens
  assert (first != greedy).any()
  top1 = decoders((1, ()), Sampling(temperature=2.0, top_k=1)).generate(PROMPT, NEW, seed=3)
  np.testing.assert_array_equal(top1.tokens, greedy)


def test_stop_token_ends_every_row(decoders):
  greedy = decoders((1, ())).generate(PROMPT, NEW).tokens[0]
  stop = int(greedy[4])
  out = decoders((1, ())).generate(PROMPT, NEW, stop_token=stop).tokens[0]
  first = int(np.argmax(greedy == stop))
  np.testing.assert_array_equal(out, greedy[:first + 1])


# --- the command --------------------------------------------------------------------------------


def test_command_prints_the_prompt_and_its_greedy_continuation(folder, decoders, capsys):
  prompt = "The plan"
  assert main(["--from", f"hf:{folder}", "--prompt", prompt, "--max-new-tokens", "12",
               "--config.mesh.tp=8", "--config.ntp.failed=3"]) == 0
  out, err = capsys.readouterr()
  codec = PromptCodec(open_origin(f"hf:{folder}", {}))
  ids = codec.encode(prompt)
  new = decoders(UNEVEN).generate(ids[None], 12, stop_token=codec.stop_token).tokens[0]
  assert out == codec.decode(list(ids) + new.tolist()) + "\n"
  assert out.startswith(prompt)
  assert "TP degree 7 (mesh.tp=8, live slots 0,1,2,4,5,6,7)" in err
  assert "new tokens, greedy" in err


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A run of 2 training steps on one device with a checkpoint at step 2 (its own BPE
  tokenizer in WORKDIR/data)."""
  from helpers import micro_config

  from ntp_jax.training.trainer import train
  workdir = tmp_path_factory.mktemp("run")
  config = micro_config(workdir, **{"mesh.tp": 1, "train.steps": 2, "checkpoint.every": 2,
                                   "train.batch_size": 4,
                                   "data.path": os.path.join(ROOT, "docs", "design.md")})
  config.model.update(vocab_size=512, d_model=64, n_layers=1, d_ff=128, n_heads=4,
                      n_kv_heads=4)
  train(config, log=lambda *a, **k: None)
  return str(workdir)


def test_command_on_a_run_checkpoint_in_a_new_process(run_dir):
  """``python -m ntp_jax.generate`` as a user runs it, on the run's workdir, degree 7."""
  env = process_env()  # the command sets the device count
  done = subprocess.run(
      [sys.executable, "-m", "ntp_jax.generate", "--from", run_dir, "--prompt", "The plan",
       "--max-new-tokens", "8", "--config.mesh.tp=8", "--config.ntp.failed=3"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert done.stdout.startswith("The plan")
  assert "checkpoint" in done.stderr and "TP degree 7" in done.stderr
  # The tokenizer the trainer keeps beside the checkpoints.
  assert f"tokenizer: {os.path.join(run_dir, 'checkpoints', 'tokenizer.json')}\n" in done.stderr
  # The step folder and the checkpoints folder name the same model: the same text.
  again = subprocess.run(
      [sys.executable, "-m", "ntp_jax.generate", "--from", os.path.join(run_dir, "checkpoints",
                                                                        "2"),
       "--prompt", "The plan", "--max-new-tokens", "8"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert again.returncode == 0, again.stderr
  assert again.stdout == done.stdout


def _no_tokenizer(folder, tmp_path):
  bare = tmp_path / "bare"
  bare.mkdir()
  for name in ("config.json", "model.safetensors"):
    os.symlink(os.path.join(folder, name), bare / name)
  return f"hf:{bare}"


def _empty(folder, tmp_path):
  (tmp_path / "empty").mkdir()
  return str(tmp_path / "empty")


BAD = {  # kind -> (--from, other arguments, what the one line says)
    "missing hf folder": (lambda f, t: "hf:/no/such/folder", [], "--from: no folder /no/such"),
    "missing folder": (lambda f, t: "/no/such/run", [], "--from: no folder /no/such/run"),
    "no checkpoint": (_empty, [], "holds no complete checkpoint"),
    "no tokenizer": (_no_tokenizer, [], "has no tokenizer.json"),
    "max-new-tokens 0": (None, ["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    "max-new-tokens not a number": (None, ["--max-new-tokens", "x"], "--max-new-tokens"),
    "prompt too long": (None, ["--prompt", "word " * 60],
                        f"longer than the model's maximum sequence length {MAX_LEN}"),
    "continuation too long": (None, ["--max-new-tokens", str(MAX_LEN)],
                              "--max-new-tokens: 48 after the prompt's"),
    "empty prompt": (None, ["--prompt", ""], "--prompt: '' encodes to no tokens"),
    "negative temperature": (None, ["--temperature", "-1"], "--temperature"),
    "top-k without temperature": (None, ["--top-k", "5"], "--top-k: 5 needs --temperature"),
    "unknown flag": (None, ["--beam", "3"], "--beam: unknown argument"),
    "not a generation setting": (None, ["--config.train.steps=3"], "--config.train.steps"),
    "unknown model field": (None, ["--config.model.width=3"], "--config.model.width"),
    "bad mesh.tp": (None, ["--config.mesh.tp=two"], "--config.mesh.tp"),
    "too few devices": (None, ["--config.mesh.tp=16"], "mesh.tp: 16 devices needed, 8 present"),
    "bad failed slot": (None, ["--config.mesh.tp=8", "--config.ntp.failed=9"],
                        "ntp.failed: slot 9"),
    "step of an hf folder": (None, ["--step", "3"], "--step"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_input_is_one_line_naming_it_and_status_2(kind, folder, tmp_path, capsys):
  where, extra, message = BAD[kind]
  origin = where(folder, tmp_path) if where else f"hf:{folder}"
  args = ["--from", origin, "--prompt", "The plan", "--max-new-tokens", "4"] + extra
  assert main(args) == 2
  out, err = capsys.readouterr()
  assert out == ""
  assert err.count("\n") == 1 and err.startswith("generate: "), err
  assert message in err, err


def test_missing_prompt_is_named(capsys):
  assert main(["--from", "hf:x"]) == 2
  assert "--prompt" in capsys.readouterr().err


def test_a_run_without_the_tokenizer_beside_its_checkpoints(run_dir, tmp_path, capsys):
  """Older runs: the tokenizer of the trainer's data cache; none at all is one line."""
  copy = str(tmp_path / "run")
  shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("compile_cache"))
  os.remove(os.path.join(copy, "checkpoints", "tokenizer.json"))
  args = ["--from", copy, "--prompt", "The plan", "--max-new-tokens", "4"]
  assert main(args) == 0
  out, err = capsys.readouterr()
  assert out.startswith("The plan")
  assert f"tokenizer: {os.path.join(copy, 'data')}" in err
  shutil.rmtree(os.path.join(copy, "data"))
  assert main(args) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--from: no tokenizer for this run" in err, err
