"""Every command-line mistake of ``train.py`` is one line naming the file or the field, exit
status 2 (``ntp_jax.training.cli``), parsed in this process (real runs of ``train.py``:
``tests/system/test_cli_runs.py``)."""

import importlib
import os
import sys

import ml_collections
import pytest
from absl import flags
from helpers import ROOT
from ml_collections import config_flags

from models.gpt import GPTConfig
from ntp_jax.errors import ConfigError
from ntp_jax.model import load_model_spec
from ntp_jax.training.cli import config_path, parse_command_line
from ntp_jax.training.config import RunConfig

TINY = os.path.join(ROOT, "configs", "gpt_tiny.py")


def _parse(monkeypatch, *args, config=TINY):
  """``parse_command_line`` on a fresh flag set, as ``train.py --config CONFIG ARGS``."""
  argv = ["train.py", *(["--config", str(config)] if config else []), *args]
  monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads the overrides from sys.argv
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, "config file", flag_values=values)
  parse_command_line(argv, values)
  return holder.value


def _error(monkeypatch, *args, config=TINY) -> str:
  with pytest.raises(ConfigError) as err:
    _parse(monkeypatch, *args, config=config)
  assert "\n" not in str(err.value)
  return str(err.value)


def test_good_overrides_parse(monkeypatch):
  config = _parse(monkeypatch, "--config.train.steps=7", "--config.ntp.failed=3")
  assert config.train.steps == 7 and config.ntp.failed == "3"


def test_config_path_forms():
  assert config_path(["p", "--config", "a.py"]) == "a.py"
  assert config_path(["p", "--config=b.py:x", "--config.train.steps=3"]) == "b.py:x"
  assert config_path(["p", "--config.train.steps=3"]) is None


def test_missing_config_file_names_it(monkeypatch):
  assert _error(monkeypatch, config="configs/missing.py") == (
      "--config: no config file configs/missing.py")
  assert _error(monkeypatch, config=None).startswith("--config: required")


@pytest.mark.parametrize("body,raised", [
    ("def get_config():\n  raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("def get_config():\n  raise ValueError('bad value')\n", "ValueError: bad value"),
    ("def get_config():\n  return {}.missing\n", "AttributeError:"),
    ("def get_config(:\n  pass\n", "SyntaxError: invalid syntax"),
    ("def get_config():\n  return open('/nonexistent/file')\n", "FileNotFoundError:"),
])
def test_a_config_file_that_raises_names_the_file_and_its_error(monkeypatch, tmp_path, body,
                                                                 raised):
  path = tmp_path / "bad.py"
  path.write_text(body)
  text = _error(monkeypatch, config=path)
  assert text.startswith(f"{path}: loading it raised {raised}"), text


def test_a_config_file_without_get_config_says_so(monkeypatch, tmp_path):
  path = tmp_path / "plain.py"
  path.write_text("x = 1\n")
  # ml_collections loads every config file as one module, re-run in the namespace an
  # earlier test's file left (its get_config too): start from none, as a process does.
  monkeypatch.delitem(sys.modules, "config_config", raising=False)
  assert _error(monkeypatch, config=path).startswith(f"{path}: defines no get_config()")


def test_dash_h_prints_the_help(monkeypatch, capsys):
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config file", flag_values=values)
  flags.DEFINE_boolean("help", False, "show this help", flag_values=values)  # as absl.app does
  parse_command_line(["train.py", "-h"], values)  # absl exits on --help; here a flag is set
  assert values["help"].value


@pytest.mark.parametrize("arg,expected", [
    ("--config.train.steps=abc", "train.steps: expected a whole number, got 'abc'"),
    ("--config.train.lr=fast", "train.lr: expected a number, got 'fast'"),
    ("--config.train.plot=maybe", "train.plot: expected True or False, got 'maybe'"),
    ("--config.train.stepz=3", "train.stepz: no such config field; did you mean train.steps?"),
    ("--config.trian.steps=3", "trian: no such config field; did you mean train?"),
    ("--verbose", "--verbose: no such flag"),
    ("leftover", "leftover: unexpected argument(s)"),
    ("--config.ntp.faild=3", "ntp.faild: no such config field"),
    ("--config.mesh.tpp=2", "mesh.tpp: no such config field"),
])
def test_a_bad_override_names_the_field(monkeypatch, arg, expected):
  assert _error(monkeypatch, arg).startswith(expected)


def test_unknown_model_factory_is_one_line():
  config = importlib.import_module("configs.gpt_tiny").get_config()
  with pytest.raises(ConfigError, match=r"^model.factory: cannot import 'nosuch.models'"):
    load_model_spec("nosuch.models:spec", config)


@pytest.mark.parametrize("field", ["dtype", "param_dtype"])
def test_an_unsupported_dtype_names_the_field_and_the_supported_ones(field):
  model = importlib.import_module("configs.gpt_tiny").get_config().model
  model[field] = "float16"
  with pytest.raises(ConfigError, match=rf"^model.{field}: 'float16' is not supported; choose "
                                        r"one of float32, bfloat16$"):
    GPTConfig.from_config(model)


def test_negative_warmup_is_refused():
  config = importlib.import_module("configs.gpt_tiny").get_config()
  config.train.warmup_steps = -5
  with pytest.raises(ConfigError, match=r"^train.warmup_steps: must be >= 0, got -5$"):
    RunConfig.from_config(ml_collections.ConfigDict(config))


def test_a_field_the_config_file_made_up_names_the_file_and_the_closest_field():
  config = importlib.import_module("configs.gpt_tiny").get_config()
  config.train.stepz = 5
  with pytest.raises(ConfigError, match=r"^my_config.py: train.stepz: no such config field; "
                     r"did you mean train.steps\?$"):
    RunConfig.from_config(config, "my_config.py")
  del config.train["stepz"]
  config.checkpointz = ml_collections.ConfigDict()
  with pytest.raises(ConfigError, match=r"^checkpointz: no such config field; did you mean "
                     r"checkpoint\?$"):
    RunConfig.from_config(config)
