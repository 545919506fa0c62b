"""A model that is not the GPT trains under NTP through the public API, and decodes through
its spec (``ModelSpec.decoding``) from its checkpoint."""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, micro_config
from jax.sharding import PartitionSpec as P
from layer_check import global_to_logical

import examples.mlp_lm
from examples.mlp_lm import model_spec
from ntp_jax.errors import ConfigError
from ntp_jax.generate.cli import main as generate_main
from ntp_jax.generate.decoder import Decoder
from ntp_jax.generate.origin import open_origin, place
from ntp_jax.layers.shard import tp_call
from ntp_jax.model import load_model_spec
from ntp_jax.sharding.mesh import TP
from ntp_jax.training.trainer import train


def _config(tmp_path, **overrides):
  config = micro_config(tmp_path, **overrides)
  config.model.factory = "examples.mlp_lm:model_spec"
  return config


def test_own_model_on_an_uneven_plan_equals_one_device(tmp_path):
  # d_ff 192 and vocabulary 512 on 3 live slots of 4: uneven blocks.
  short = {"train.steps": 12, "train.warmup_steps": 2, "train.lr": 1e-2}
  ntp = train(_config(tmp_path, **{"mesh.tp": 4, "ntp.failed": "1", **short}),
              log=lambda *_: None)
  single = train(_config(tmp_path, **{"mesh.tp": 1, **short}), log=lambda *_: None)
  assert [r.degree for r in ntp.plan.replicas] == [3]
  np.testing.assert_allclose(ntp.losses, single.losses, rtol=1e-4)
  assert ntp.losses[-1] < ntp.losses[0] - 0.2  # it learns
  # The programs hold the model's own parameters, not a GPT's.
  names = {"/".join(str(k) for k in path) for path, _ in
           __import__("flax").nnx.to_flat_state(ntp.programs[0].params)}
  assert "mlp/gate/kernel" in names and not any(n.startswith("blocks") for n in names)


def test_spec_given_directly_equals_the_factory_by_name(tmp_path):
  config = _config(tmp_path, **{"mesh.tp": 2, "train.steps": 3})
  by_name = train(config, log=lambda *_: None).losses
  direct = train(micro_config(tmp_path, **{"mesh.tp": 2, "train.steps": 3}),
                 model=model_spec(config), log=lambda *_: None).losses
  assert by_name == direct


@pytest.mark.parametrize("factory,message", [
    ("examples.mlp_lm", "is not 'package.module:function'"),
    ("examples.nothing_here:spec", "cannot import 'examples.nothing_here'"),
    ("examples.mlp_lm:no_such", "has no 'no_such'"),
])
def test_bad_factory_is_one_line_naming_the_field(tmp_path, factory, message):
  config = micro_config(tmp_path)
  config.model.factory = factory
  with pytest.raises(ConfigError, match=f"model.factory: .*{message}"):
    load_model_spec(config.model.factory, config)


# --- generation from the model's checkpoint -------------------------------------------------


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """2 training steps of the example on one device, a checkpoint at step 2 (its own BPE)."""
  workdir = tmp_path_factory.mktemp("mlp_run")
  config = _config(workdir, **{"mesh.tp": 1, "train.steps": 2, "checkpoint.every": 2,
                               "train.batch_size": 4,
                               "data.path": os.path.join(ROOT, "docs", "design.md")})
  config.model.update(vocab_size=512, d_model=32, d_ff=64)
  train(config, log=lambda *a, **k: None)
  return str(workdir)


def test_own_model_decodes_on_an_uneven_plan_as_its_full_forward(run_dir):
  origin = open_origin(run_dir, {})
  assert origin.spec.name == "mlp_lm" and origin.max_len == 32  # gpt_micro's train.seq_len
  prompt = np.array([[5, 17, 42, 99, 3, 250]], np.int32)
  uneven = Decoder(*place(origin, 4, (1,)))  # degree 3: d_ff 64 and vocabulary 512 uneven
  out = uneven.generate(prompt, 8, keep_logits=True)
  one = Decoder(*place(origin, 1)).generate(prompt, 8).tokens
  np.testing.assert_array_equal(out.tokens, one)
  # Each step's logits are the full forward's at that position, on the same plan.
  sequence = np.concatenate([prompt, out.tokens[:, :-1]], axis=1)
  model = nnx.merge(uneven.graphdef, uneven.state)
  blocks = tp_call(model, uneven.mesh, jnp.asarray(sequence), out_specs=P(None, None, TP))
  full = np.asarray(global_to_logical(blocks, uneven.vocab))[0, prompt.shape[1] - 1:]
  np.testing.assert_allclose(out.logits[:, 0], full, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(out.tokens[0], full.argmax(-1))  # greedy


def test_generate_command_on_the_own_model(run_dir, capsys):
  assert generate_main(["--from", run_dir, "--prompt", "The plan", "--max-new-tokens", "6",
                        "--config.mesh.tp=4", "--config.ntp.failed=1"]) == 0
  out, err = capsys.readouterr()
  assert out.startswith("The plan")
  assert f"model: checkpoint {os.path.join(run_dir, 'checkpoints', '2')} (mlp_lm," in err
  assert "plan: TP degree 3 (mesh.tp=4, live slots 0,2,3); placed in" in err


def test_a_model_without_decoding_is_refused_in_one_line(run_dir, capsys, monkeypatch):
  made = examples.mlp_lm.model_spec
  monkeypatch.setattr(examples.mlp_lm, "model_spec",
                      lambda config: dataclasses.replace(made(config), decoding=None))
  assert generate_main(["--from", run_dir, "--prompt", "The plan"]) == 2
  out, err = capsys.readouterr()
  assert out == ""
  assert err == ("generate: model.factory: examples.mlp_lm:model_spec makes a model that "
                 "cannot decode (its ModelSpec has no decoding: a cached forward, "
                 "docs/custom_model.md)\n")


@pytest.mark.parametrize("override,message", [
    ("--config.model.dtype=bfloat16", "--config.model.dtype: no such model field "
                                      "(vocab_size, d_model, d_ff)"),
    ("--config.model.d_ff=x", "--config.model.d_ff: expected int, got 'x'"),
])
def test_model_overrides_are_the_models_own_fields(run_dir, capsys, override, message):
  assert generate_main(["--from", run_dir, "--prompt", "The plan", override]) == 2
  err = capsys.readouterr().err
  assert err == f"generate: {message}\n"
