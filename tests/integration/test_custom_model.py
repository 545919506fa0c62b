"""A model that is not the GPT trains under NTP through the public API."""

import numpy as np
import pytest
from helpers import tiny_config

from examples.mlp_lm import model_spec
from ntp_jax.errors import ConfigError
from ntp_jax.train.model_spec import load_model_spec
from ntp_jax.train.trainer import train


def _config(tmp_path, **overrides):
  config = tiny_config(tmp_path, **overrides)
  config.model.factory = "examples.mlp_lm:model_spec"
  return config


def test_own_model_on_an_uneven_plan_equals_one_device(tmp_path):
  # d_ff 384 and vocabulary 2048 on 3 live slots of 4: uneven blocks.
  ntp = train(_config(tmp_path, **{"mesh.tp": 4, "ntp.failed": "1", "train.steps": 12,
                                  "train.warmup_steps": 2}),
              log=lambda *_: None)
  single = train(_config(tmp_path, **{"mesh.tp": 1, "train.steps": 12, "train.warmup_steps": 2}),
                 log=lambda *_: None)
  assert [r.degree for r in ntp.plan.replicas] == [3]
  np.testing.assert_allclose(ntp.losses, single.losses, rtol=1e-4)
  assert ntp.losses[-1] < ntp.losses[0] - 0.2  # it learns (7.62 -> 7.31 in 12 steps)
  # The programs hold the model's own parameters, not a GPT's.
  names = {"/".join(str(k) for k in path) for path, _ in
           __import__("flax").nnx.to_flat_state(ntp.programs[0].params)}
  assert "mlp/gate/kernel" in names and not any(n.startswith("blocks") for n in names)


def test_spec_given_directly_equals_the_factory_by_name(tmp_path):
  config = _config(tmp_path, **{"mesh.tp": 2, "train.steps": 3})
  by_name = train(config, log=lambda *_: None).losses
  direct = train(tiny_config(tmp_path, **{"mesh.tp": 2, "train.steps": 3}),
                 model=model_spec(config), log=lambda *_: None).losses
  assert by_name == direct


@pytest.mark.parametrize("factory,message", [
    ("examples.mlp_lm", "is not 'package.module:function'"),
    ("examples.nothing_here:spec", "cannot import 'examples.nothing_here'"),
    ("examples.mlp_lm:no_such", "has no 'no_such'"),
])
def test_bad_factory_is_one_line_naming_the_field(tmp_path, factory, message):
  config = tiny_config(tmp_path)
  config.model.factory = factory
  with pytest.raises(ConfigError, match=f"model.factory: .*{message}"):
    load_model_spec(config.model.factory, config)
