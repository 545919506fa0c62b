"""The memory and compute plan: abstract shapes only, figures checked by hand counts."""

import dataclasses
import json
import os
import re
import resource
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import ROOT, micro_config, process_env

import configs.gpt_8b
import configs.gpt_70b
from models.gpt import GPTConfig, count_params, gpt_spec
from ntp_jax.analysis.hlo_collectives import collectives
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
  config = _dry(micro_config(tmp_path, **{"mesh.dp": 2, "mesh.tp": 4, "ntp.failed": "1:2",
                                         "train.seq_len": 256}))
  summary = train(config, log=logged.append)
  assert summary.dry_run and not os.listdir(tmp_path)  # no data, metrics or checkpoints
  footprints = summary.footprints
  assert [f.replica_class.degree for f in footprints] == [4, 3]
  assert all(f.temp > 0 and f.flops > 0 for f in footprints)
  assert "dry run: the devices can hold this plan" in logged
  # One line: whether each plan fits an 80 GB GPU (this one, with a failed slot already).
  [fit] = [line for line in logged if line.startswith("fits 80 GiB per device")]
  assert fit.startswith("fits 80 GiB per device (an 80 GB GPU): this plan (TP 3) yes, ")
  assert not [line for line in logged if line.startswith("after a failed slot")]


def test_dry_run_of_a_healthy_plan_shows_where_a_failure_leads(tmp_path):
  """A healthy plan's dry run also prints the plan one failed slot leads to, with the
  configured optimizer state, and one line on whether each fits; a device too small for
  either says at which DP the sharded state would fit."""
  from ntp_jax.training.optim import zero_settings
  from ntp_jax.training.resources import fit_line
  logged = []
  config = _dry(micro_config(tmp_path, **{"mesh.dp": 2, "mesh.tp": 4,
                                         "train.optimizer_sharding": "zero1"}))
  summary = train(config, log=logged.append)
  [after] = [i for i, line in enumerate(logged) if line.startswith("after a failed slot")]
  assert "7 live devices" in logged[after]
  assert "zero1 k=1 (2 pieces)" in logged[after + 1]
  [fit] = [line for line in logged if line.startswith("fits 80 GiB per device")]
  assert re.search(r"healthy \(TP 4\) yes, [\d.]+ GiB in a (step|save); 1 failed slot \(TP 3\) "
                   r"yes", fit), fit
  # Judged against a device that holds half the fullest device's pieces more than its
  # need without them: at DP 4 the pieces are half as large.
  run = RunConfig.from_config(config)
  spec = gpt_spec(GPTConfig.from_config(config.model), 0)
  import ntp_jax.training.resources as resources
  from ntp_jax.training.footprint import piece_element_bytes, sync_buffer_lengths
  fullest = max(summary.footprints, key=lambda f: f.need)
  plan = plan_of(config, spec, "")
  zero = zero_settings(run.train)
  lengths = sync_buffer_lengths(plan, spec.make)
  element = piece_element_bytes(plan, spec.make, jax.devices(), zero, lengths)
  small = (fullest.need - resources.sharded_state_bytes(zero, lengths, element, 2)
           + resources.sharded_state_bytes(zero, lengths, element, 4))
  original = resources.REFERENCE_DEVICE_BYTES
  try:
    resources.REFERENCE_DEVICE_BYTES = small
    line = fit_line(run, spec, [("healthy", plan, summary.footprints)], jax.devices(), {})
  finally:
    resources.REFERENCE_DEVICE_BYTES = original
  assert " no, " in line and line.endswith("zero1 k=1 fits from DP 4 (same batch share per "
                                           "replica)"), line


def test_full_remat_keeps_less_and_recomputes_more(tmp_path):
  config = micro_config(tmp_path, **{"mesh.tp": 4, "train.seq_len": 256})
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
  config = micro_config(tmp_path, **{"model.n_layers": 5, "mesh.tp": 4, "ntp.failed": "1"})
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


def _leaf_sizes(cfg) -> list[int]:
  """Logical elements of every parameter of a GPT, counted from its config:
  each block parameter stacked over the layers, then the tables and the final norm."""
  return [cfg.n_layers * n for n in _layer_sizes(cfg)] + [n for _, n in _table_sizes(cfg)]


def _layer_sizes(cfg) -> list[int]:
  """Elements of one layer's parameters: attention, norm, MLP, norm."""
  d, ff = cfg.d_model, cfg.d_ff
  q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  return [d * q, d * kv, d * kv, q * d, d, d * ff, d * ff, ff * d, d]


def _table_sizes(cfg) -> list[tuple[bool, int]]:
  """``(split, elements)`` of the embedding, the head and the final norm."""
  d, v = cfg.d_model, cfg.vocab_size
  return [(True, v * d), (True, d * v), (False, d)]


def test_zero1_optimizer_bytes_match_the_hand_count(tmp_path):
  """gpt_micro (float32) on 2 x 4: a core device keeps a piece of each sync buffer three
  times (master weights, two moments) and two int32 step counts. The split parameters of
  the stacked layers are laid out layer by layer in a ``[layers, L]`` buffer (each one's
  run at t_min positions per layer); the tables, the norms (replicated: whole, stacked or
  not) and the loss element in a flat one."""
  from ntp_jax.parallel.zero import piece_count
  from ntp_jax.training.footprint import (
    piece_element_bytes,
    sync_buffer_lengths,
    zero_state_bytes,
  )
  from ntp_jax.training.optim import zero_settings
  from ntp_jax.training.resources import resident_bytes, sharded_state_bytes
  config = micro_config(tmp_path, **{"mesh.dp": 2, "mesh.tp": 4,
                                    "train.optimizer_sharding": "zero1"})
  cfg = GPTConfig.from_config(config.model)
  sizes = _leaf_sizes(cfg)
  assert sum(sizes) == count_params(cfg)
  run = RunConfig.from_config(config)
  optimizer, zero = make_optimizer(run.train), zero_settings(run.train)
  layers, norms = cfg.n_layers, (4, 8)  # the layer's two norms: replicated
  for failed, t_min in (("", 4), ("1:2", 3)):
    plan = plan_of(config, gpt_spec(cfg, 0), failed)
    per_layer = sum(-(-n // t_min) for i, n in enumerate(_layer_sizes(cfg)) if i not in norms)
    flat = (sum(-(-n // t_min) for _, n in _table_sizes(cfg))
            + sum(-(-layers * _layer_sizes(cfg)[i] // t_min) for i in norms) + 1)  # the loss
    shapes = {"float32": (flat,), f"float32/{layers} layers": (layers, per_layer)}
    assert sync_buffer_lengths(plan, gpt_spec(cfg, 0).make) == shapes
    pieces = piece_count(2, 1)
    assert pieces == 2
    hand = (-(-flat // pieces) + layers * -(-per_layer // pieces)) * 12 + 2 * 4
    assert zero_state_bytes(plan, gpt_spec(cfg, 0).make, jax.devices(), zero) == hand
    element = piece_element_bytes(plan, gpt_spec(cfg, 0).make, jax.devices(), zero, shapes)
    assert element == dict.fromkeys(shapes, 12)  # float32 master weights and two moments
    assert sharded_state_bytes(zero, shapes, element, 2) == hand - 8  # no step counts
    # About a quarter of the logical parameters' 12 bytes each: 2 pieces of 1/t_min.
    assert hand == pytest.approx(count_params(cfg) / t_min / pieces * 12, rel=0.01)
    # Two copies: every replica holds the whole buffers' state.
    two = dataclasses.replace(zero, copies=2)
    length = flat + layers * per_layer
    assert zero_state_bytes(plan, gpt_spec(cfg, 0).make, jax.devices(), two) == length * 12 + 8
    footprints = class_footprints(plan, gpt_spec(cfg, 0).make, optimizer, 1.0,
                                  config.train.seq_len, jax.devices(), zero=zero)
    assert [f.opt_state for f in footprints] == [hand] * len(plan.classes)
    assert all(f.optimizer == "zero1 k=1 (2 pieces)" for f in footprints)
    # The gradient buffers live with the summed pieces (the master weights' shapes).
    assert all(f.outputs >= length * 4 + (hand - 8) // 3 and f.temp > 0 for f in footprints)
    assert resident_bytes(plan, gpt_spec(cfg, 0).make, optimizer, jax.devices(), zero=zero) == [
        f.params + hand for f in footprints]
    replicated = class_footprints(plan, gpt_spec(cfg, 0).make, optimizer, 1.0,
                                  config.train.seq_len, jax.devices())
    assert [f.params for f in replicated] == [f.params for f in footprints]
    assert all(f.opt_state == 2 * f.params + 8 for f in replicated)  # Adam: mu, nu, a count
    # A save reads the state back into the class layout (as a replicated run holds it), one
    # moment's whole float32 buffers gathered at a time, beside the class's float32 packed
    # buffers (length elements on each device of the class).
    for f, r in zip(footprints, replicated, strict=True):
      assert r.opt_state + 2 * length * 4 <= f.read_back <= r.opt_state + 3 * length * 4
      assert f.save_peak == f.params + hand + f.read_back and f.need >= f.save_peak
      assert r.read_back == 0 and r.save_peak == r.params + r.opt_state


def _sharded_step_parts(tmp_path, dp, tp, failed, **settings):
  """``(plan, each class's abstract sync buffers, the plan's ShardedOptimizer, its
  settings)`` for gpt_micro on ``dp x tp`` with ``failed`` (config overrides ``settings``)."""
  from ntp_jax.parallel.steps import SplitStep, StepSettings, abstract_sync_blocks
  from ntp_jax.training.footprint import sharded_optimizer
  from ntp_jax.training.optim import zero_settings
  config = micro_config(tmp_path, **{"mesh.dp": dp, "mesh.tp": tp, "ntp.failed": failed,
                                    **settings})
  cfg = GPTConfig.from_config(config.model)
  plan = plan_of(config, gpt_spec(cfg, 0), failed)
  run = RunConfig.from_config(config)
  optimizer = make_optimizer(run.train)
  step_settings = StepSettings(optimizer, 1.0, plan.global_batch * config.train.seq_len)
  blocks = []
  for c in plan.classes:
    program, batch = abstract_program(plan, c, gpt_spec(cfg, 0).make, optimizer,
                                      config.train.seq_len, jax.devices())
    step = SplitStep.build(program.graphdef, program.params, program.opt_state, program.mesh,
                           step_settings, plan.t_min)
    blocks.append(abstract_sync_blocks(step.grad, program.params, batch, program.mesh))
  zero = zero_settings(run.train)
  return plan, blocks, sharded_optimizer(plan, jax.devices(), zero), zero


def _groupings(lowered) -> set[str]:
  """The device groupings of a lowered program's collectives, as its compiled HLO writes
  them (groups of one device, which send nothing, left out)."""
  text = lowered.compile().as_text()
  return {g for g in re.findall(r"replica_groups=(\{[{}\d,]*\}|\[[\d,]+\]<=\S+)", text)
          if re.search(r"\{\d+,|\[\d+,(?!1\])", g)}


def test_the_sharded_update_lowers_for_abstract_buffers(tmp_path):
  """``ShardedOptimizer.lower_step``: its compiled arguments are one core device's gradient
  buffer and sharded state, as ``abstract_state`` says."""
  from ntp_jax.training.footprint import sharded_optimizer
  plan, blocks, sharded, zero = _sharded_step_parts(
      tmp_path, 2, 4, "1:2", **{"train.optimizer_sharding": "zero1"})
  with pytest.raises(ValueError, match="no class's sync buffers"):
    sharded.lower_step([])
  state = sharded.abstract_state(blocks)
  length = sum(int(np.prod(x.shape[2:])) for x in blocks[0].values())  # one device's
  assert len(blocks[0]) == 2  # the flat buffer and the stacked layers'
  assert {x.dtype for x in jax.tree.leaves(state) if x.ndim} == {np.dtype("float32")}
  pieces = device_bytes(state["master"])

  def argument_bytes(optimizer, rounds=1):
    return [(what, lowered.compile().memory_analysis().argument_size_in_bytes)
            for what, lowered in optimizer.lower_step(blocks, rounds)]

  # What consumes the state runs no collective (a step that commits runs it after its vote).
  # Each program's collectives group the devices one way (a peer lost in one leaves no
  # collective of another grouping half-entered), and the update holds none (a step that
  # commits runs it after its vote).
  groups = {what: {(c.kind, c.group_size) for c in collectives(lowered.compile().as_text())}
            for what, lowered in sharded.lower_step(blocks)}
  assert groups["sharded optimizer (update)"] == set(), groups
  assert {k for k, _ in groups["sharded optimizer (reduce)"]} <= {"reduce-scatter",
                                                                  "all-reduce"}, groups
  # Two pieces (one copy): the reduction and the gathering among the 2 replicas of a peer
  # group (the all-reduce over one copy is a group of one: nothing sent), the norm over
  # every core device (2 replicas x t_min 3).
  assert {n for _, n in groups["sharded optimizer (reduce)"]} - {1} == {2}, groups
  assert groups["sharded optimizer (norm)"] == {("all-reduce", 6)}, groups
  assert groups["sharded optimizer (parameters gathered)"] == {("all-gather", 2)}, groups
  # zero1: the step's buffers reduced, the norm from one value per device, the pieces and
  # the state updated, the master weights' pieces gathered.
  assert argument_bytes(sharded) == [
      ("sharded optimizer (reduce)", length * 4),
      ("sharded optimizer (norm)", 8),
      ("sharded optimizer (update)", pieces + 4 + device_bytes(state)),
      ("sharded optimizer (parameters gathered)", pieces)]
  # zero2 over three rounds: a micro-batch's buffer, then with the summed pieces.
  zero2 = sharded_optimizer(plan, jax.devices(), dataclasses.replace(zero, stage=2))
  assert [n for _, n in argument_bytes(zero2, rounds=3)] == [
      length * 4, length * 4 + pieces, length * 4 + pieces, 8,
      pieces + 4 + device_bytes(state), pieces]


def test_each_sharded_program_groups_the_devices_one_way(tmp_path):
  """dp=4 tp=2 with replica 3 at degree 1, zero2 with two copies of two pieces: a round's
  reduce-scatter over a copy's replicas and its sum over the copies are programs of their
  own, and no program of the step mixes two groupings of the devices (a peer lost inside
  one leaves no collective of another grouping half-entered, ``processes.commit``)."""
  _, blocks, sharded, _ = _sharded_step_parts(
      tmp_path / "two", 4, 2, "3:1", **{"train.optimizer_sharding": "zero2",
                                       "train.optimizer_copies": 2})
  assert sharded.reduce_in_two
  groupings = {what: _groupings(lowered) for what, lowered in sharded.lower_step(blocks, 3)}
  assert len(groupings) == 7 == len(sharded.step_runs(3)), groupings
  assert all(len(g) <= 1 for g in groupings.values()), groupings
  scatter, first = (groupings[f"sharded optimizer ({w})"] for w in (
      "reduce over each copy", "sum over the copies, first micro-batch"))
  assert len(scatter) == len(first) == 1 and scatter != first, groupings


def _huge_vocabulary():
  """gpt_70b on 2 x 4 with a 600,000-token vocabulary: one device's flat embedding block
  (1.2e9 elements at TP degree 4) and its sync run reach past int32 indexing, at any depth
  (the stacked layers are laid out layer by layer and never do)."""
  config = configs.gpt_70b.get_config()
  config.mesh.dp, config.mesh.tp = 2, 4
  config.train.batch_size = 8
  config.model.vocab_size = 600_000
  return config


def test_the_warning_that_a_failure_would_stop_the_run_comes_before_the_memory_check(
    tmp_path, monkeypatch):
  """A replicated run whose failure plan cannot be built: the warning that a failed slot
  would stop the run is printed before the memory plan, which on this host stops the run
  (stood in for here by a ``ResourceError`` at once, as the plan of thousands of GiB would
  give)."""
  from ntp_jax.training import trainer
  from ntp_jax.training.resources import ResourceError

  def no_memory(*args, **kwargs):
    raise ResourceError("the plan needs more host memory than there is")

  monkeypatch.setattr(trainer, "check_footprint", no_memory)
  config = _huge_vocabulary()
  config.train.optimizer_sharding = "replicated"
  config.workdir = str(tmp_path)
  logged = []
  with pytest.raises(ResourceError):
    train(config, log=logged.append)
  assert [line for line in logged if line.startswith("warning: a failed slot would stop this "
                                                     "run: on the plan it leads to (TP degrees "
                                                     "[3, 4])")], logged


def test_a_step_past_int32_indexing_is_refused_before_compiling(tmp_path):
  """A flat parameter past int32 indexing (``_huge_vocabulary``): zero1's footprint and a
  run's start say so from shapes alone, naming the parameter (a run whose plan has one TP
  degree and a replicated optimizer is warned that a failure would stop it)."""
  from ntp_jax.errors import ConfigError
  from ntp_jax.training.footprint import check_split_step, failure_overrun
  from ntp_jax.training.optim import zero_settings
  config = _huge_vocabulary()
  run = RunConfig.from_config(config)
  spec = gpt_spec(GPTConfig.from_config(config.model), 0)
  plan = plan_of(config, spec, "")
  started = time.monotonic()
  table = r"the split step at TP degree 4 would index [\d,]+ elements of embed/embedding"
  with pytest.raises(OverflowError, match=table + " per device with int32"):
    class_footprints(plan, spec.make, make_optimizer(run.train), 1.0,
                     config.train.seq_len, jax.devices(), zero=zero_settings(run.train))
  with pytest.raises(ConfigError, match=r"^model: .* TP degrees \[4, 4\]: " + table):
    check_split_step(plan, spec, sharded=True)
  # Replicated, one TP degree: the fused step builds; a failed slot's plan would not.
  asked = []
  warning = failure_overrun(
      plan, frozenset(), lambda failed: asked.append(failed) or plan_for(run, spec, failed),
      spec, sharded=False)
  assert asked == [{(0, 3)}]  # the first replica's last live slot
  assert warning.startswith("a failed slot would stop this run: on the plan it leads to "
                            "(TP degrees [3, 4]) the split step at TP degree "), warning
  # A run stops at its start, before the memory plan compiles anything or data is read.
  config.workdir = str(tmp_path)
  with pytest.raises(ConfigError, match=r"^model: gpt on the plan with TP degrees \[4, 4\]"):
    train(config, log=lambda *_: None)
  assert os.listdir(tmp_path) == []
  assert time.monotonic() - started < 30  # shapes only: nothing compiled


def test_llama_3_70b_degree_7_step_and_sync_lower_from_shapes():
  """gpt_70b (Llama-3-70B's shapes, 80 layers) with one failed slot: the degree-7 class's
  split step and the cross-replica sync lower from shapes alone (``tests/programs/
  lower_70b.py``, 16 simulated devices). Its stacked parameters are synced layer by layer
  (``[80, L]`` buffers), so no index passes int32."""
  proc = subprocess.run([sys.executable, "tests/programs/lower_70b.py"], cwd=ROOT,
                        env=process_env(devices=16), capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["degrees"] == [7, 8]
  assert got["buffers"]["bfloat16/80 layers"][0] == 80
  assert max(shape[-1] for shape in got["buffers"].values()) < 2 ** 31 - 1
  # [replicas, degree, layers, L] for the degree-7 class's one replica.
  assert got["class_buffers"]["bfloat16/80 layers"][:3] == [1, 7, 80]
  assert got["lowered"] == [True, True] and got["sync_all_reduce"]
