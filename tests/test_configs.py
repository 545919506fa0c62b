"""Every file in configs/ loads, validates and plans."""

import functools
import importlib
import os

import pytest

from models.gpt import GPTConfig, model_layouts
from ntp_jax.parallel.plan import make_plan

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
NAMES = sorted(f[:-3] for f in os.listdir(CONFIG_DIR) if f.endswith(".py") and f != "__init__.py")


@pytest.mark.parametrize("name", NAMES)
def test_config_loads_and_plans(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  for field in ("mesh.tp", "ntp.failed", "train.steps", "train.seed", "workdir"):
    node = config
    for part in field.split("."):
      node = node[part]
  cfg = GPTConfig.from_config(config.model)
  plan = make_plan(functools.partial(model_layouts, cfg), tp=config.mesh.tp, dp=config.mesh.dp,
                   failed=config.ntp.failed, batch_size=config.train.batch_size)
  assert plan.global_batch == config.train.batch_size


def test_unknown_model_field_is_rejected():
  config = importlib.import_module("configs.gpt_tiny").get_config()
  config.model.unlocked = 1  # a field GPTConfig does not have
  with pytest.raises(ValueError, match=r"model: unknown field\(s\) \['unlocked'\]"):
    GPTConfig.from_config(config.model)
