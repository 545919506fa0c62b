"""Compiling ahead: the plans one failure or repair away are compiled before they are met."""

import functools
import os

import jax
import pytest
from flax import nnx
from helpers import WaitForAhead, micro_config

import configs.gpt_micro
from models.gpt import GPT, GPTConfig, model_layouts
from ntp_jax.errors import ConfigError
from ntp_jax.parallel.plan import make_plan, reachable_failed_sets
from ntp_jax.parallel.programs import PlanPrograms, ProgramCache
from ntp_jax.training.compilation import set_up_cache
from ntp_jax.training.config import RunConfig
from ntp_jax.training.metrics import read_records
from ntp_jax.training.optim import make_optimizer
from ntp_jax.training.trainer import train

MESH = {"mesh.dp": 2, "mesh.tp": 2, "ntp.rebalance": "equal"}
# A failure, a second failure in the other replica, and a repair of the first.
EVENTS = {"ntp.fail_at": "3@0:1,5@1:0", "ntp.repair_at": "7@0:1", "train.steps": 9}
EVENT_STEPS = {3, 5, 7}


def run(workdir, precompile, lines=None, **overrides):
  config = micro_config(workdir, **{**MESH, **EVENTS, "ntp.precompile": precompile, **overrides})
  log = (lines.append if lines is not None else lambda *_: None)
  return train(config, log=lambda line, *_, **__: log(line), hooks=[WaitForAhead(EVENT_STEPS)])


def test_reachable_failed_sets_are_one_failure_or_one_repair_away():
  assert reachable_failed_sets(frozenset({(0, 1)}), dp=2, tp=2) == [
      {(0, 1), (0, 0)}, {(0, 1), (1, 0)}, {(0, 1), (1, 1)}, frozenset()]
  assert len(reachable_failed_sets(frozenset(), dp=2, tp=4)) == 8


def test_a_recovery_compiled_ahead_compiles_nothing_and_changes_no_loss(tmp_path):
  lines = []
  ahead = run(tmp_path / "ahead", "next_failure", lines)
  plain = run(tmp_path / "plain", "none")
  # The very programs the loop calls, compiled in another thread: identical results (that a
  # live recovery keeps the uninterrupted run's losses is tests/integration/test_live_recovery).
  assert ahead.losses == plain.losses
  rows = [r for r in read_records(ahead.metrics_path) if r.get("event") == "recovered"]
  assert [r["step"] for r in rows] == [3, 5, 7]
  for row in rows:
    assert row["compiled_ahead"] and row["compile_s"] == 0.0, row
    assert {"plan_s", "move_s", "wait_s", "first_step_s"} <= set(row)
  plain_rows = [r for r in read_records(plain.metrics_path) if r.get("event") == "recovered"]
  assert not any(r["compiled_ahead"] for r in plain_rows)
  # The failure meets a plan this run has not compiled: the measure sees the compile. (The
  # repair's plan was met before; its moves may be cached in this process by the other run.)
  assert plain_rows[0]["compile_s"] > 0, plain_rows[0]
  assert [r["tp_degrees"] for r in ahead.records] == (
      [[2, 2]] * 3 + [[1, 2]] * 2 + [[1, 1]] * 2 + [[2, 1]] * 2)
  assert any(line.startswith("compiled ahead: ") for line in lines)
  assert any("programs compiled ahead" in line for line in lines)
  # No silent wait: a plan not compiled ahead says it compiles.
  assert not any("compiling the programs of this plan" in line for line in lines
                 if not line.startswith("  step 0:"))


def test_the_restart_path_compiles_no_step_ahead_of_it(tmp_path):
  result = run(tmp_path, "next_failure", **{"ntp.recovery": "restart", "checkpoint.every": 2,
                                            "checkpoint.dir": str(tmp_path / "ckpt")})
  rows = [r for r in read_records(result.metrics_path) if r.get("event") == "recovered"]
  assert [r["path"] for r in rows] == ["restart"] * 3
  assert all(r["compiled_ahead"] and r["compile_s"] == 0.0 for r in rows), rows


def test_a_class_program_does_not_depend_on_which_slot_failed():
  """The same lowered program for every failed-slot position: on GPU, where the persistent
  cache key leaves the device assignment out, one compile serves all of them."""
  cfg = GPTConfig.from_config(configs.gpt_micro.get_config().model)
  optimizer = make_optimizer(RunConfig.from_config(micro_config("unused")).train)
  texts = []
  for slot in (0, 2):
    plan = make_plan(functools.partial(model_layouts, cfg), tp=4, dp=1, failed={(0, slot)},
                     batch_size=4)
    programs = PlanPrograms(plan, lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(0)),
                            optimizer, 1.0, plan.global_batch * 16, jax.devices()[:4],
                            cache=ProgramCache())
    [(_, _, lowered)] = programs.lower(16)
    texts.append(lowered.as_text())
  assert texts[0] == texts[1]


def test_the_bound_on_programs_stops_the_compile_ahead(tmp_path):
  lines = []
  config = micro_config(tmp_path, **{**MESH, "ntp.precompile": "next_failure", "train.steps": 2,
                                    "ntp.precompile_max_programs": 1})
  train(config, log=lambda line, *_, **__: lines.append(line), hooks=[WaitForAhead({1})])
  assert any("stopped at 1 programs (ntp.precompile_max_programs)" in line for line in lines)


def test_the_persistent_cache_lives_under_the_workdir_or_where_told(tmp_path, monkeypatch):
  environment = os.environ["JAX_COMPILATION_CACHE_DIR"]  # conftest's, shared by the run
  try:
    assert set_up_cache("", str(tmp_path)) == environment
    assert set_up_cache(str(tmp_path / "mine"), str(tmp_path)) == str(tmp_path / "mine")
    assert os.path.isdir(tmp_path / "mine")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert set_up_cache("", str(tmp_path)) == os.path.join(tmp_path, "compile_cache")
    assert set_up_cache("none", str(tmp_path)) is None
    assert jax.config.jax_compilation_cache_dir is None
  finally:
    monkeypatch.undo()
    assert set_up_cache("", str(tmp_path)) == environment  # later tests share the run's cache
  assert jax.config.jax_compilation_cache_dir == environment


@pytest.mark.parametrize("field,value", [("ntp.precompile", "always"),
                                         ("ntp.precompile_max_programs", -1),
                                         ("ntp.precompile_max_host_gb", -1.0)])
def test_bad_precompile_settings_name_the_field(tmp_path, field, value):
  with pytest.raises(ConfigError, match=f"^{field}: "):
    RunConfig.from_config(micro_config(tmp_path, **{field: value}))
