"""End-to-end training: parity across TP layouts, metrics, and bad input from the CLI."""

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, tiny_config

import configs.gpt_tiny
from ntp_jax.train.metrics import read_metrics
from ntp_jax.train.trainer import train


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return tmp_path_factory.mktemp("tiny")


def test_losses_equal_for_uniform_nonuniform_and_single_device(workdir):
  runs = {
      "tp8": dict(),
      "tp8-failed3": {"ntp.failed": "3"},
      "tp1": {"mesh.tp": 1},
  }
  losses = {name: train(tiny_config(workdir, **o), log=lambda *_: None).losses
            for name, o in runs.items()}
  for name in ("tp8-failed3", "tp1"):
    np.testing.assert_allclose(losses[name], losses["tp8"], rtol=1e-4, err_msg=name)
  assert len(losses["tp1"]) == 10


def test_two_replicas_of_different_degree_match_single_device(workdir):
  """AdamW and clipping through the cross-class sync: replicas at TP degree 4 and 3."""
  ntp = train(tiny_config(workdir, **{"mesh.dp": 2, "mesh.tp": 4, "ntp.failed": "1:2",
                                      "ntp.rebalance": "equal"}), log=lambda *_: None)
  single = train(tiny_config(workdir, **{"mesh.tp": 1}), log=lambda *_: None)
  assert [r.degree for r in ntp.plan.replicas] == [4, 3]
  np.testing.assert_allclose(ntp.losses, single.losses, rtol=1e-4)


def test_metrics_jsonl_has_one_full_precision_record_per_step(workdir):
  summary = train(tiny_config(workdir, **{"ntp.failed": "2,5", "train.steps": 3}),
                  log=lambda *_: None)
  records = read_metrics(summary.metrics_path)
  assert [r["step"] for r in records] == [0, 1, 2]
  for r, loss in zip(records, summary.losses):
    assert {"step", "loss", "tokens", "step_time_s", "tp_degree"} <= set(r)
    assert r["loss"] == loss and r["tp_degree"] == 6 and r["tokens"] == 16 * 64
    assert r["tp_degrees"] == [6]


def _cli(*args, env_extra=None):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.update(env_extra or {})
  return subprocess.run([sys.executable, "train.py", "--config", "configs/gpt_tiny.py", *args],
                        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("args,field", [
    (["--config.ntp.failed=3;5"], "ntp.failed"),
    (["--config.ntp.failed=9"], "ntp.failed"),
    (["--config.ntp.failed=0,1,2,3,4,5,6,7"], "ntp.failed"),
    (["--config.data.path=/nonexistent/corpus.txt"], "data.path"),
    (["--config.ntp.slot_weights=1,2"], "ntp.slot_weights"),
    (["--config.train.log_every=0"], "train.log_every"),
    (["--config.train.batch_size=0"], "train.batch_size"),
    (["--config.ntp.faild=3"], "ntp.faild"),
    (["--config.mesh.tpp=2"], "mesh.tpp"),
])
def test_bad_input_is_one_line_naming_the_field(args, field, tmp_path):
  result = _cli(*args, f"--config.workdir={tmp_path}")
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert lines[-1].startswith(f"error: {field}:"), result.stderr[-2000:]
  assert "Traceback" not in result.stderr


def test_empty_corpus_is_a_clear_error(tmp_path):
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  result = _cli(f"--config.data.path={empty}", f"--config.workdir={tmp_path}")
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1].startswith("error: data.path:")


def test_default_tiny_run_lowers_the_loss(tmp_path):
  """The README's main command, as is (default steps and corpus), on simulated devices."""
  result = _cli(f"--config.workdir={tmp_path}", "--config.ntp.failed=3")
  assert result.returncode == 0, result.stderr[-3000:]
  losses = [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")]
  assert len(losses) == configs.gpt_tiny.get_config().train.steps
  assert np.mean(losses[-10:]) < np.mean(losses[:5]) - 1.5, (losses[:5], losses[-10:])
  assert "TP degree 7" in result.stdout
