"""End-to-end training: parity across TP layouts, metrics, and bad settings or input as one
line naming the field (in this process, from ``train``; the real
``train.py`` runs are in ``tests/system/test_cli_runs.py``)."""

import numpy as np
import pytest
from helpers import micro_config

from ntp_jax.data import DataError
from ntp_jax.errors import ConfigError
from ntp_jax.training.metrics import read_metrics
from ntp_jax.training.trainer import train


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="module")
def single_device(workdir):
  """The single-device run (``mesh.tp=1``, 10 steps): both parity tests below compare with
  it, so it runs once for both."""
  return train(micro_config(workdir, **{"mesh.tp": 1}), log=lambda *_: None).losses


def test_losses_equal_for_uniform_nonuniform_and_single_device(workdir, single_device):
  runs = {
      "tp8": dict(),
      "tp8-failed3": {"ntp.failed": "3"},
  }
  losses = {name: train(micro_config(workdir, **o), log=lambda *_: None).losses
            for name, o in runs.items()}
  losses["tp1"] = single_device
  for name in ("tp8-failed3", "tp1"):
    np.testing.assert_allclose(losses[name], losses["tp8"], rtol=1e-4, err_msg=name)
  assert len(losses["tp1"]) == 10


def test_two_replicas_of_different_degree_match_single_device(workdir, single_device):
  """AdamW and clipping through the cross-class sync: replicas at TP degree 4 and 3."""
  ntp = train(micro_config(workdir, **{"mesh.dp": 2, "mesh.tp": 4, "ntp.failed": "1:2",
                                      "ntp.rebalance": "equal"}), log=lambda *_: None)
  assert [r.degree for r in ntp.plan.replicas] == [4, 3]
  np.testing.assert_allclose(ntp.losses, single_device, rtol=1e-4)


def test_metrics_jsonl_has_one_full_precision_record_per_step(workdir):
  summary = train(micro_config(workdir, **{"ntp.failed": "2,5", "train.steps": 3}),
                  log=lambda *_: None)
  records = read_metrics(summary.metrics_path)
  assert [r["step"] for r in records] == [0, 1, 2]
  for r, loss in zip(records, summary.losses):
    assert {"step", "loss", "tokens", "step_time_s", "tp_degree"} <= set(r)
    assert r["loss"] == loss and r["tp_degree"] == 6 and r["tokens"] == 16 * 32
    assert r["tp_degrees"] == [6]


@pytest.mark.parametrize("field,value", [
    ("ntp.failed", "3;5"),
    ("ntp.failed", "9"),
    ("ntp.failed", "0,1,2,3,4,5,6,7"),
    ("ntp.slot_weights", "1,2"),
    ("train.log_every", 0),
    ("train.batch_size", 0),
])
def test_a_bad_setting_is_one_line_naming_the_field(tmp_path, field, value):
  with pytest.raises(ConfigError) as err:
    train(micro_config(tmp_path, **{field: value}), log=lambda *_: None)
  assert str(err.value).startswith(f"{field}:") and "\n" not in str(err.value), err.value


@pytest.mark.parametrize("corpus", ["missing", "empty"])
def test_a_missing_or_empty_corpus_is_one_line_naming_data_path(tmp_path, corpus):
  path = tmp_path / "corpus.txt"
  if corpus == "empty":
    path.write_text("")
  with pytest.raises((ConfigError, DataError)) as err:
    train(micro_config(tmp_path, **{"data.path": str(path)}), log=lambda *_: None)
  assert str(err.value).startswith("data.path:") and "\n" not in str(err.value), err.value


@pytest.mark.parametrize("field,value", [
    ("model.d_model", -3),
    ("model.factory", "nope:model_spec"),
    ("ntp.failed", "9"),
    ("data.path", "/no/such/corpus"),
])
def test_a_config_error_creates_nothing(tmp_path, field, value):
  """Refused before the workdir, its compile_cache or anything else is created."""
  config = micro_config(tmp_path / "run", **{field: value})
  with pytest.raises((ConfigError, DataError)) as err:
    train(config, log=lambda *_: None)
  assert str(err.value).startswith(f"{field}:"), err.value
  assert not (tmp_path / "run").exists()
