"""Hugging Face Llama weights into NTP plans against transformers' logits; export round trip.

The reference logits come from ``transformers.LlamaForCausalLM`` on CPU
(``tests/fixtures/make_hf_reference.py``, not run here: torch and
transformers are not test dependencies); the folders are rebuilt from the
same seeds with numpy and safetensors.
"""

import importlib.util
import json
import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from layer_check import global_to_logical

import configs.base
from models.gpt import GPT, GPTConfig, model_layouts
from ntp_jax.errors import ConfigError
from ntp_jax.interop.hf_llama import HFSource, export_hf, read_hf_config, tokenizer_file
from ntp_jax.layers.shard import replica_view, to_logical, tp_call
from ntp_jax.parallel.programs import abstract_class_state
from ntp_jax.sharding.mesh import TP, class_mesh
from ntp_jax.state.placement import flatten, place_logical

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
_spec = importlib.util.spec_from_file_location(
    "make_hf_reference", os.path.join(_FIXTURES, "make_hf_reference.py"))
fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture)
REFERENCE = np.load(fixture.REFERENCE)

# Degrees 1, 3 and 7 (slot 3 failed): vocabulary 61, d_ff 40 and 2 KV heads split unevenly.
PLANS = [(1, ()), (3, ()), (8, (3,))]


def _folder(tmp_path, variant):
  folder = str(tmp_path / variant)
  fixture.write_model(folder, variant)
  return folder


def _place(cfg, source, tp, failed):
  """The model of plan ``(tp, failed)`` filled from ``source``, its mesh and layouts."""
  layouts = model_layouts(cfg, tp, failed)
  mesh = class_mesh([0], [layouts.heads.live_slots], tp)
  graphdef, target = abstract_class_state(lambda: GPT(cfg, layouts, rngs=nnx.Rngs(0)), 1,
                                          optax.sgd(1.0))
  placed, filled = place_logical({"params": target["params"]}, mesh, source)
  assert filled == source.paths()
  return nnx.merge(graphdef, replica_view(placed["params"])), mesh, layouts


def _logits(model, mesh, layouts, tokens):
  """Logical logits ``[batch, seq, vocab]`` gathered from the slots' vocabulary blocks."""
  blocks = tp_call(model, mesh, tokens, out_specs=P(None, None, TP))
  return global_to_logical(blocks, layouts.vocab)


@pytest.mark.parametrize("variant", list(fixture.VARIANTS))
def test_logits_match_transformers_on_uneven_plans(tmp_path, variant, monkeypatch):
  import ntp_jax.interop.hf_llama as hf
  folder = _folder(tmp_path, variant)
  cfg = GPTConfig(**read_hf_config(folder))
  assert cfg.tie_embeddings == fixture.VARIANTS[variant]["tied"]
  reads = []  # (tensor name, logical slice) of every read from the files
  real_read = hf._read_slice

  def recorded(tensor, name, ranges):
    reads.append((name.hf, tuple((s.start, s.stop) for s in ranges)))
    return real_read(tensor, name, ranges)

  monkeypatch.setattr(hf, "_read_slice", recorded)
  tokens = REFERENCE["tokens"]
  expected = REFERENCE[f"logits_{variant}"]
  for tp, failed in PLANS:
    reads.clear()
    model, mesh, layouts = _place(cfg, HFSource(folder, cfg), tp, failed)
    assert ("head" in nnx.state(model)) != cfg.tie_embeddings
    np.testing.assert_allclose(_logits(model, mesh, layouts, tokens), expected, atol=1e-4,
                               err_msg=f"{variant} on tp={tp} failed={failed}")
    if layouts.degree == 7:
      # wq [2, 32, 32] in 4 even pieces: each device read only its 8 columns, once.
      wq = sorted(r for n, r in reads if n.endswith("q_proj.weight"))
      assert wq == [((0, 2), (0, 32), (c, c + 8)) for c in range(0, 32, 8)]
      kernel = model.blocks.attn.wq.get_value()
      assert {s.data.shape for s in kernel.addressable_shards} == {
          (1, 2, 32, layouts.heads.block * 4 * 4)}


@pytest.mark.parametrize("variant", list(fixture.VARIANTS))
def test_export_then_import_is_bit_exact(tmp_path, variant):
  from safetensors.numpy import load_file
  folder = str(tmp_path / variant)
  # As stored (bfloat16 in the tied variant): exported as float32, exactly.
  stored = {k: np.asarray(v, np.float32) for k, v in fixture.write_model(folder, variant).items()}
  cfg = GPTConfig(**read_hf_config(folder))
  model, _, _ = _place(cfg, HFSource(folder, cfg), 8, (3,))
  logical = to_logical(nnx.state(model))
  out = str(tmp_path / "exported")
  export_hf(logical, cfg, out, max_position_embeddings=64)
  assert read_hf_config(out) == read_hf_config(folder)
  written = load_file(os.path.join(out, "model.safetensors"))
  assert set(written) == set(stored)
  for name, value in stored.items():
    assert written[name].dtype == np.float32
    np.testing.assert_array_equal(written[name], value, err_msg=name)
  # Flat paths (with the "params" prefix) write the same file.
  export_hf({("params",) + p: v for p, v in flatten(logical).items()}, cfg, str(tmp_path / "flat"))
  assert load_file(str(tmp_path / "flat" / "model.safetensors")).keys() == written.keys()
  # Back into another plan: every logical parameter equal.
  again, _, _ = _place(cfg, HFSource(out, cfg), 3, ())
  jax.tree.map(np.testing.assert_array_equal, to_logical(nnx.state(again)), logical)


def _stored_checkpoint(tmp_path):
  """``tmp_path/ckpt``: step 4 of the untied fixture's weights, as train() stores a run (no
  tokenizer copy beside it)."""
  from ntp_jax.state.checkpoint import Checkpoints
  folder = _folder(tmp_path, "untied")
  cfg = GPTConfig(**read_hf_config(folder))
  model, _, _ = _place(cfg, HFSource(folder, cfg), 3, ())
  logical = {("params",) + p: v for p, v in flatten(to_logical(nnx.state(model))).items()}
  moments = {("opt_state", "0", "mu") + p[1:]: v * 0 for p, v in logical.items()}
  checkpoints = Checkpoints(str(tmp_path / "ckpt"), asynchronous=False)
  model_fields = {k: getattr(cfg, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads",
                                                "n_kv_heads", "head_dim", "d_ff", "rope_theta",
                                                "norm_eps")}
  config = configs.base.get_config()  # the run config a checkpoint stores, as train() writes it
  config.model.update(model_fields)
  config.train.seq_len = 16
  checkpoints.save(4, {**logical, **moments},
                   {"config": json.loads(config.to_json_best_effort())})
  checkpoints.close()
  return str(tmp_path / "ckpt")


def test_export_command_reads_a_checkpoint(tmp_path, capsys):
  from safetensors.numpy import load_file

  from ntp_jax.interop.export_hf import main
  _stored_checkpoint(tmp_path)
  out = str(tmp_path / "hf")
  assert main(["--checkpoint", str(tmp_path / "ckpt"), "--out", out]) == 0
  written = load_file(os.path.join(out, "model.safetensors"))
  for name, value in fixture.tensors("untied").items():
    np.testing.assert_array_equal(written[name], value, err_msg=name)
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["max_position_embeddings"] == 16
  assert main(["--checkpoint", str(tmp_path / "ckpt"), "--step", "9", "--out", out]) == 2
  assert main(["--checkpoint", str(tmp_path / "none"), "--out", out]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  # A checkpoint folder without the trainer's tokenizer copy: one warning, no tokenizer files.
  assert err[0].startswith("export_hf: warning: --checkpoint: ") and "no tokenizer.json" in err[0]
  assert not os.path.exists(os.path.join(out, "tokenizer.json"))
  err = err[1:]
  assert len(err) == 2 and "--step: " in err[0] and "ckpt/9 is not a complete" in err[0], err
  assert err[1].endswith("--checkpoint: no folder " + str(tmp_path / "none")), err
  assert not os.path.exists(tmp_path / "none")


def test_export_refuses_a_folder_not_empty_or_a_file_unless_forced(tmp_path, capsys):
  """A user's config.json and another model's shard index in --out: refused in one line,
  exit status 2, nothing touched; --force writes over it and removes the stale index (which a
  loader would read instead of model.safetensors); --out naming a file: one line."""
  from safetensors.numpy import load_file

  from ntp_jax.interop.export_hf import main
  ckpt = _stored_checkpoint(tmp_path)
  out = tmp_path / "hf"
  out.mkdir()
  (out / "config.json").write_text('{"mine": 1}')
  (out / "model.safetensors.index.json").write_text('{"weight_map": {"x": "model-1.safetensors"}}')
  assert main(["--checkpoint", ckpt, "--out", str(out)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"export_hf: --out: {out} is not empty (config.json, "
                 "model.safetensors.index.json); name a new or empty folder, or pass --force to "
                 "write over it (removing the weight files of any other model there)"]
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors.index.json"]
  assert (out / "config.json").read_text() == '{"mine": 1}'
  assert main(["--checkpoint", ckpt, "--out", str(out), "--force"]) == 0
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
  assert set(load_file(str(out / "model.safetensors"))) == set(fixture.tensors("untied"))
  assert "mine" not in json.loads((out / "config.json").read_text())
  capsys.readouterr()
  (tmp_path / "file").write_text("x")
  assert main(["--checkpoint", ckpt, "--out", str(tmp_path / "file")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"export_hf: --out: {tmp_path / 'file'} is a file, not a folder; name a new "
                 "or empty folder"]
  # A run's workdir is accepted as generate --from takes it.
  (tmp_path / "run").mkdir()
  os.rename(ckpt, tmp_path / "run" / "checkpoints")
  assert main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf2")]) == 0


@pytest.mark.parametrize("change,message", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"config\.json: rope_scaling "),
    ({"rope_parameters": {"rope_type": "yarn"}}, r"config\.json: rope_parameters\.rope_type"),
    ({"attention_bias": True}, r"config\.json: attention_bias true is not supported"),
    ({"mlp_bias": True}, r"config\.json: mlp_bias true"),
    ({"hidden_act": "gelu"}, r"config\.json: hidden_act 'gelu'"),
    ({"model_type": "mistral"}, r"model_type 'mistral' is not supported; accepted: llama"),
    ({"hidden_size": None}, r"config\.json: hidden_size is missing"),
])
def test_unsupported_config_is_one_line_naming_the_key(tmp_path, change, message):
  folder = _folder(tmp_path, "untied")
  path = os.path.join(folder, "config.json")
  with open(path) as f:
    config = json.load(f)
  with open(path, "w") as f:
    json.dump({**config, **change}, f)
  with pytest.raises(ConfigError, match=message) as err:
    read_hf_config(folder)
  assert "\n" not in str(err.value)


def test_missing_files_and_tensors_are_named(tmp_path):
  from safetensors.numpy import load_file, save_file
  with pytest.raises(ConfigError, match=r"empty/config\.json: missing"):
    read_hf_config(str(tmp_path / "empty"))
  folder = _folder(tmp_path, "untied")
  cfg = GPTConfig(**read_hf_config(folder))
  assert tokenizer_file(folder) is None
  open(os.path.join(folder, "tokenizer.json"), "w").close()
  assert tokenizer_file(folder) == os.path.join(folder, "tokenizer.json")
  import dataclasses
  with pytest.raises(ConfigError, match=r"model\.rope_theta: 500000\.0, but .*config\.json "
                                        r"gives 10000\.0"):
    HFSource(folder, dataclasses.replace(cfg, rope_theta=500_000.0))
  weights = os.path.join(folder, "model.safetensors")
  tensors = load_file(weights)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, weights)
  with pytest.raises(ConfigError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight is "
                                        "missing"):
    HFSource(folder, cfg)
  os.remove(weights)
  with pytest.raises(ConfigError, match=r"model\.safetensors: missing"):
    HFSource(folder, cfg)
  # Shards without an index file are found by their headers.
  sharded = _folder(tmp_path, "tied")
  os.remove(os.path.join(sharded, "model.safetensors.index.json"))
  tied = GPTConfig(**read_hf_config(sharded))
  assert len(set(HFSource(sharded, tied).files.values())) == 2
