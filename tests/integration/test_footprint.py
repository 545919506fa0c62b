"""The memory and compute plan: abstract shapes only, figures checked by hand counts."""

import dataclasses
import os
import re
import resource
import subprocess
import sys
import time

import jax
import pytest
from helpers import ROOT, process_env, tiny_config

import configs.gpt_8b
from models.gpt import GPTConfig, count_params, gpt_spec
from ntp_jax.training.config import RunConfig, parse_failed
from ntp_jax.training.footprint import (
  abstract_program,
  class_footprints,
  device_bytes,
  host_memory_available,
)
from ntp_jax.training.loop import plan_for
from ntp_jax.training.optim import make_optimizer
from ntp_jax.training.resources import footprint
from ntp_jax.training.trainer import train

GIB = 2 ** 30


def _gpt_8b_cli(*args):
  """train.py on gpt_8b: (return code, stdout, stderr, seconds, max RSS bytes)."""
  env = process_env()
  start = time.monotonic()
  proc = subprocess.Popen([sys.executable, "train.py", "--config", "configs/gpt_8b.py", *args],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env)
  try:
    out, err = proc.communicate(timeout=300)
  except subprocess.TimeoutExpired:
    proc.kill()
    raise
  return proc.returncode, out, err, time.monotonic() - start


def _params_gib(stdout: str) -> float:
  lines = stdout.splitlines()
  header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["class", "TP"])
  row = lines[header + 1].split()
  return float(row[3])


def test_gpt_8b_on_a_cpu_host_prints_the_plan_and_stops_in_one_line(tmp_path):
  cfg = GPTConfig.from_config(configs.gpt_8b.get_config().model)
  have = host_memory_available()
  if have is None or have > 600 * GIB:
    pytest.skip("this host could hold gpt_8b's step: it would train")
  # The degraded plan's table comes from the same figures, checked against the hand count
  # in this process (test_parameter_bytes_per_device_match_the_hand_count).
  rc, out, err, seconds = _gpt_8b_cli(f"--config.workdir={tmp_path}")
  # The largest child this process has waited for (earlier ones are small test runs).
  peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
  assert rc == 2, err[-2000:]
  lines = [line for line in err.splitlines() if line.strip()]
  assert re.match(r"error: the plan needs [\d.]+ GiB of host memory for 8 CPU devices",
                  lines[-1]), err[-2000:]
  assert "Traceback" not in err
  assert "TFLOP/step" in out and "tokens per step: 65,536" in out
  assert seconds < 300
  assert peak_kib * 1024 < 8e9, peak_kib
  # Every device holds 1/8 of every split parameter: the blocks sum to the model.
  per_device = _params_gib(out) * GIB / 4
  assert abs(8 * per_device - count_params(cfg)) < 0.002e9, 8 * per_device
  assert abs(count_params(cfg) - 8.03e9) < 0.005e9


def _degraded_over_healthy(cfg) -> float:
  """Per-device parameters at TP 7 over TP 8, counted by hand.

  MLP columns (56 units of 256) and vocabulary rows split 8/7 larger; the
  8 KV groups are 1 per slot at TP 8 and 1 own + 1 shared at TP 7 (twice the
  attention weights); norm scales are replicated.
  """
  d, layers, group, hd = cfg.d_model, cfg.n_layers, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
  norms = (2 * layers + 1) * d

  def per_device(kv_groups, ffn_cols, vocab_rows):
    attn = d * kv_groups * hd * (2 * group + 2)
    return layers * (attn + 3 * d * ffn_cols) + 2 * vocab_rows * d + norms

  healthy = per_device(1, cfg.d_ff // 8, cfg.vocab_size // 8)
  degraded = per_device(2, cfg.d_ff // 7, -(-cfg.vocab_size // 7))
  return degraded / healthy


def plan_of(config, model, failed: str):
  """The trainer's plan of ``config`` with ``failed`` (``ntp.failed`` text) for ``model``."""
  run = RunConfig.from_config(config)
  return plan_for(run, model, parse_failed(failed, run.mesh.dp, run.mesh.tp))


def test_parameter_bytes_per_device_match_the_hand_count():
  config = configs.gpt_8b.get_config()
  cfg = GPTConfig.from_config(config.model)
  optimizer = make_optimizer(config.train)
  sizes = {}
  for failed in ("", "3"):
    plan = plan_of(config, gpt_spec(cfg, 0), failed)
    program, _ = abstract_program(plan, plan.classes[0], gpt_spec(cfg, 0).make, optimizer,
                                  config.train.seq_len, jax.devices())
    sizes[failed] = device_bytes(program.params)
    # Adam: two float32 moments per parameter (and a step count).
    assert abs(device_bytes(program.opt_state) - 2 * sizes[failed]) < 64
  norms_8 = 8 * (2 * cfg.n_layers + 1) * cfg.d_model * 4  # replicated on every device
  assert sizes[""] * 8 - norms_8 == (count_params(cfg) - (2 * cfg.n_layers + 1) * cfg.d_model) * 4
  assert sizes["3"] / sizes[""] == pytest.approx(_degraded_over_healthy(cfg), rel=1e-12)


def _dry(config):
  config.dry_run = True
  return config


def test_dry_run_allocates_nothing_and_reports_every_class(tmp_path):
  logged = []
  config = _dry(tiny_config(tmp_path, **{"mesh.dp": 2, "mesh.tp": 4, "ntp.failed": "1:2",
                                         "train.seq_len": 256}))
  summary = train(config, log=logged.append)
  assert summary.dry_run and not os.listdir(tmp_path)  # no data, metrics or checkpoints
  footprints = summary.footprints
  assert [f.replica_class.degree for f in footprints] == [4, 3]
  assert all(f.temp > 0 and f.flops > 0 for f in footprints)
  assert "dry run: the devices can hold this plan" in logged


def test_full_remat_keeps_less_and_recomputes_more(tmp_path):
  config = tiny_config(tmp_path, **{"mesh.tp": 4, "train.seq_len": 256})
  args = (make_optimizer(config.train), 1.0, config.train.seq_len, jax.devices())
  figures = {}
  for remat in ("none", "full"):
    cfg = dataclasses.replace(GPTConfig.from_config(config.model), remat=remat,
                              scan_layers=False)  # unrolled: cost analysis counts every layer
    plan = plan_of(config, gpt_spec(cfg, 0), "")
    figures[remat] = class_footprints(plan, gpt_spec(cfg, 0).make, *args)[0]
  plain, full = figures["none"], figures["full"]
  assert full.temp < plain.temp and full.flops > plain.flops
  assert (full.params, full.opt_state) == (plain.params, plain.opt_state)


def test_flops_extended_from_two_layers_equal_the_unrolled_model(tmp_path):
  config = tiny_config(tmp_path, **{"model.n_layers": 5, "mesh.tp": 4, "ntp.failed": "1"})
  cfg = GPTConfig.from_config(config.model)
  plan = plan_of(config, gpt_spec(cfg, 0), "1")
  args = (make_optimizer(config.train), 1.0, config.train.seq_len, jax.devices())
  extended = footprint(RunConfig.from_config(config), gpt_spec(cfg, 0), plan, args[0],
                       args[3])[0].flops
  unrolled = dataclasses.replace(cfg, scan_layers=False)
  measured = class_footprints(plan, gpt_spec(unrolled, 0).make, *args)[0].flops
  scanned = class_footprints(plan, gpt_spec(cfg, 0).make, *args)[0].flops
  # XLA fuses a few elementwise ops differently from one depth to the next (~1e-7).
  assert extended == pytest.approx(measured, rel=1e-6)
  assert scanned < measured  # the loop body counted once: why the extension is needed
