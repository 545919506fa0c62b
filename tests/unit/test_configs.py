"""Every file in configs/ loads, validates and plans; every config mistake is one line naming
the field (``ntp_jax.training.config``)."""

import functools
import importlib
import os

import pytest
from helpers import ROOT

from models.gpt import GPTConfig, model_layouts
from ntp_jax.errors import ConfigError
from ntp_jax.parallel.plan import make_plan
from ntp_jax.training.config import FIELDS, RunConfig

CONFIG_DIR = os.path.join(ROOT, "configs")
NAMES = sorted(f[:-3] for f in os.listdir(CONFIG_DIR) if f.endswith(".py") and f != "__init__.py")


@pytest.mark.parametrize("name", NAMES)
def test_config_loads_and_plans(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  for field in ("mesh.tp", "ntp.failed", "train.steps", "train.seed", "workdir"):
    node = config
    for part in field.split("."):
      node = node[part]
  run = RunConfig.from_config(config)
  cfg = GPTConfig.from_config(config.model)
  plan = make_plan(functools.partial(model_layouts, cfg), tp=run.mesh.tp, dp=run.mesh.dp,
                   failed=run.ntp.failed, batch_size=run.train.batch_size)
  assert plan.global_batch == config.train.batch_size


def test_unknown_model_field_is_rejected():
  config = importlib.import_module("configs.gpt_tiny").get_config()
  config.model.unlocked = 1  # a field GPTConfig does not have
  with pytest.raises(ValueError, match=r"model: unknown field\(s\) \['unlocked'\]"):
    GPTConfig.from_config(config.model)


def test_base_config_sets_exactly_the_fields_the_trainer_reads():
  """configs/base.py is where every default lives: it has each field, and no other."""
  config = importlib.import_module("configs.base").get_config()
  assert sorted(config) == sorted(FIELDS[""])
  for section, fields in FIELDS.items():
    if section:
      assert set(fields) <= set(config[section]), section
      if section != "model":  # the model section also holds the factory's own fields
        assert sorted(config[section]) == sorted(fields), section


@pytest.mark.parametrize("field,value,match", [
    ("workdir", "", "workdir: must not be empty"),
    ("dry_run", 1, "dry_run: expected True or False"),
    ("model.factory", 3, "model.factory: expected text"),
    ("mesh.tp", 0, "mesh.tp: must be >= 1"),
    ("mesh.dp", 1.5, "mesh.dp: expected a whole number"),
    ("ntp.failed", "9", r"ntp.failed: slot 9 in '9' does not exist \(mesh.tp=8\)"),
    ("ntp.slot_weights", "1,2", "ntp.slot_weights: 2 weights given, mesh.tp=8"),
    ("ntp.rebalance", "fair", "ntp.rebalance: 'fair' is not one of"),
    ("ntp.fail_at", "3@0", "ntp.fail_at: '3@0' is not STEP@REPLICA:SLOT"),
    ("ntp.recovery", "pray", "ntp.recovery: 'pray' is not one of live, restart"),
    ("train.steps", 0, "train.steps: must be >= 1"),
    ("train.warmup_steps", -1, "train.warmup_steps: must be >= 0"),
    ("train.lr", float("nan"), "train.lr: must be finite"),
    ("train.b2", 1.0, "train.b2: must be below 1"),
    ("train.batch_size", 3, "train.batch_size: must be >= 1|train.batch_size: 3 sequences do not"),
    ("checkpoint.keep", 0, "checkpoint.keep: must be >= 1"),
    ("checkpoint.every", -1, "checkpoint.every: must be >= 0"),
    ("distributed.heartbeat_timeout_s", 0.0, "distributed.heartbeat_timeout_s: must be > 0"),
    ("distributed.processes_per_domain", 0, "distributed.processes_per_domain: must be >= 1"),
    ("data.val_fraction", 1.0, "data.val_fraction: must be below 1"),
    ("data.max_corpus_bytes", 0, "data.max_corpus_bytes: must be >= 1"),
])
def test_a_bad_value_in_any_section_is_one_line_naming_the_field(field, value, match):
  config = importlib.import_module("configs.gpt_tiny").get_config()
  config.mesh.dp = 2 if field == "train.batch_size" else config.mesh.dp
  section, _, name = field.rpartition(".")
  node = config[section] if section else config
  with node.ignore_type():  # ml_collections would refuse some wrong types itself
    node[name] = value
  with pytest.raises(ConfigError, match=f"^({match})") as err:
    RunConfig.from_config(config)
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,match", [
    ({"train.optimizer_sharding": "zero3"},
     "train.optimizer_sharding: 'zero3' is not one of replicated, zero1, zero2"),
    ({"train.optimizer_copies": 0}, "train.optimizer_copies: must be >= 1"),
    ({"train.optimizer_copies": 2}, "train.optimizer_copies: 2 copies need "
                                    "train.optimizer_sharding=zero1"),
    ({"train.optimizer_sharding": "zero1", "train.optimizer_copies": 3},
     r"train.optimizer_copies: 3 copies of each piece need as many replicas; mesh.dp=2"),
    ({"train.optimizer_sharding": "zero2", "ntp.fail_at": "3@0:1", "checkpoint.every": 0},
     "ntp.fail_at: with train.optimizer_copies=1 the first failed device's piece"),
])
def test_optimizer_sharding_mistakes_are_one_line(overrides, match):
  config = importlib.import_module("configs.gpt_tiny").get_config()
  config.mesh.dp, config.mesh.tp = 2, 4
  for field, value in overrides.items():
    section, name = field.split(".")
    config[section][name] = value
  with pytest.raises(ConfigError, match=f"^{match}") as err:
    RunConfig.from_config(config)
  assert "\n" not in str(err.value)
  config.train.optimizer_copies = 2 if "ntp.fail_at" in overrides else 1
  config.train.optimizer_sharding = "zero1"
  RunConfig.from_config(config)  # with two copies, or fixed, it is taken


def test_zero1_needs_replicas_and_refuses_only_a_failure_that_must_lose_a_piece():
  config = importlib.import_module("configs.gpt_tiny").get_config()
  config.train.optimizer_sharding = "zero1"
  with pytest.raises(ConfigError, match="^train.optimizer_sharding: zero1 splits the "
                                        "optimizer state over the DP replicas, and mesh.dp=1"):
    RunConfig.from_config(config)
  config.mesh.dp, config.mesh.tp = 2, 4
  config.ntp.fail_at, config.checkpoint.every = "5@1:3", 0
  with pytest.raises(ConfigError, match="checkpoint.every=N"):
    RunConfig.from_config(config)
  config.ntp.failed = "0:3"  # degree 3 next to 4: slot 3 of replica 1 holds no piece
  RunConfig.from_config(config)


def test_missing_and_unknown_fields_are_named():
  config = importlib.import_module("configs.gpt_tiny").get_config()
  del config.train["plot"]
  with pytest.raises(ConfigError, match="^train.plot: missing from the config"):
    RunConfig.from_config(config)
  config = importlib.import_module("configs.gpt_tiny").get_config()
  config.checkpoint.often = True
  with pytest.raises(ConfigError, match="^checkpoint.often: no such config field"):
    RunConfig.from_config(config)


def test_parsed_values_flow_inward():
  config = importlib.import_module("configs.gpt_tiny").get_config()
  config.mesh.dp, config.mesh.tp = 2, 4
  config.ntp.failed, config.ntp.slot_weights = "3,1:2", "1,1,0.5,1"
  config.ntp.fail_at, config.ntp.repair_at = "7.mid@1:0", "9@1:0"
  run = RunConfig.from_config(config)
  assert run.ntp.failed == {(0, 3), (1, 2)}
  assert run.ntp.slot_weights == (1.0, 1.0, 0.5, 1.0)
  assert [e.describe() for e in run.ntp.events] == ["fail 7.mid@1:0", "repair 9@1:0"]
  assert run.checkpoint.dir == f"{config.workdir}/checkpoints"


def test_a_folder_that_cannot_be_made_is_one_line_naming_its_field(tmp_path):
  from ntp_jax.training.compilation import make_folder
  (tmp_path / "a_file").write_text("")
  with pytest.raises(ConfigError, match=r"^workdir: .*a_file cannot be a folder \(File exists\)$"):
    make_folder(str(tmp_path / "a_file"), "workdir")
  with pytest.raises(ConfigError, match=r"^compile.cache_dir: .*a_file/x cannot be a folder"):
    make_folder(str(tmp_path / "a_file" / "x"), "compile.cache_dir")
  make_folder(str(tmp_path / "new" / "deep"), "workdir")
  assert (tmp_path / "new" / "deep").is_dir()
