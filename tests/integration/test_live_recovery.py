"""Failures and repairs while training: live recovery from DP peers, restart, goodput."""

import functools
import os

import jax
import numpy as np
import pytest
from helpers import micro_config, run_job

from ntp_jax.errors import ConfigError
from ntp_jax.state.peer import poison
from ntp_jax.training.metrics import read_metrics, read_records
from ntp_jax.training.trainer import train

QUIET = dict(log=lambda *_: None)
MESH = {"mesh.dp": 2, "mesh.tp": 4, "ntp.rebalance": "equal"}


def run(workdir, ckpt, steps=12, **overrides):
  config = micro_config(workdir, **{"train.steps": steps, **MESH, **overrides})
  config.checkpoint.every = 4
  config.checkpoint.dir = str(ckpt)
  return train(config, **QUIET)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return tmp_path_factory.mktemp("live")


@pytest.fixture(scope="module")
def uninterrupted(workdir, tmp_path_factory):
  return run(workdir, tmp_path_factory.mktemp("whole")).losses


def test_live_failure_and_repair_keep_the_losses_and_the_degrees(workdir, tmp_path, uninterrupted):
  result = run(workdir, tmp_path, **{"ntp.fail_at": "4@0:3", "ntp.repair_at": "8@0:3",
                                     "train.plot": True})
  np.testing.assert_allclose(result.losses, uninterrupted, rtol=1e-5)
  records = read_metrics(result.metrics_path)
  degrees = [r["tp_degrees"] for r in records]
  assert degrees == [[4, 4]] * 4 + [[3, 4]] * 4 + [[4, 4]] * 4
  # Nothing redone, no sequence skipped or repeated: the cursor advances by the batch.
  assert result.redone_steps == 0
  assert [r["data_cursor"] for r in records] == [16 * (i + 1) for i in range(12)]
  # The repair returns to the healthy layout: its program is a cache hit.
  hits, misses = result.cache
  assert hits >= 1
  assert 0 < records[-1]["goodput"] <= 1 and records[-1]["effective_tokens_per_s"] > 0
  events = [r["event"] for r in read_records(result.metrics_path) if "event" in r]
  assert events[-6:] == ["start", "fail", "recovered", "repair", "recovered", "end"]
  assert os.path.getsize(os.path.join(str(workdir), "goodput.png")) > 10_000


def test_a_failure_detector_hook_drives_the_same_recovery(workdir, tmp_path, uninterrupted):
  from ntp_jax.resilience.events import DeviceFailure, Event

  def detector(step):
    if step == 4:
      raise DeviceFailure(0, 3)  # as a health check that lost a device would
    return [Event(8, False, "repair", 0, 3)] if step == 8 else []

  config = micro_config(workdir, **{"train.steps": 12, **MESH})
  config.checkpoint.every = 0
  result = train(config, detector=detector, **QUIET)
  np.testing.assert_allclose(result.losses, uninterrupted, rtol=1e-5)
  degrees = [r["tp_degrees"] for r in read_metrics(result.metrics_path)]
  assert degrees[3:5] == [[4, 4], [3, 4]] and degrees[8] == [4, 4]


def test_restart_path_and_a_failure_inside_a_step_give_the_same_losses(workdir, tmp_path,
                                                                       uninterrupted):
  result = run(workdir, tmp_path, **{"ntp.fail_at": "4.mid@0:3", "ntp.repair_at": "8@0:3",
                                     "ntp.recovery": "restart"})
  np.testing.assert_allclose(result.losses[-12:], uninterrupted, rtol=1e-5)
  assert result.redone_steps == 1
  assert result.goodput["redone"] > 0 and result.goodput["checkpoint_restore"] > 0


def test_failures_at_three_places_then_one_more(workdir, tmp_path, uninterrupted):
  result = run(workdir, tmp_path, **{"ntp.fail_at": "4@0:1,4@1:3,6@0:2"})
  np.testing.assert_allclose(result.losses, uninterrupted, rtol=1e-5)
  degrees = [r["tp_degrees"] for r in read_metrics(result.metrics_path)]
  assert degrees[3:5] == [[4, 4], [3, 3]] and degrees[6] == [2, 3]


def test_a_failure_that_drops_a_replica_live_equals_restart(workdir, tmp_path):
  drop = {"ntp.fail_at": "4@1:0,4@1:1,4@1:2,4@1:3"}
  live = run(workdir, tmp_path / "live", steps=8, **drop)
  restart = run(workdir, tmp_path / "restart", steps=8, **drop, **{"ntp.recovery": "restart"})
  assert [r.replica for r in live.plan.replicas] == [0]
  np.testing.assert_allclose(live.losses, restart.losses, rtol=1e-5)
  assert read_metrics(live.metrics_path)[-1]["global_batch"] == 8


def test_poison_overwrites_only_the_failed_devices():
  _, _, _, programs = run_job(tp=4, dp=2, steps=1)
  program = programs[0]
  dead = {program.mesh.devices[0, 3]}
  poison(programs, dead)
  kernel = program.params["head"]["kernel"].get_value()
  for shard in kernel.addressable_shards:
    assert np.isnan(np.asarray(shard.data)).all() == (shard.device in dead)


@pytest.mark.parametrize("overrides,field", [
    ({"ntp.fail_at": "20@0:9"}, "ntp.fail_at"),
    ({"ntp.fail_at": "20@0:3,25@0:3"}, "ntp.fail_at"),
    ({"ntp.fail_at": "20-0:3"}, "ntp.fail_at"),
    ({"ntp.failed": "0:1", "ntp.fail_at": "5@0:1"}, "ntp.fail_at"),
    ({"ntp.repair_at": "20@0:3"}, "ntp.repair_at"),
    ({"ntp.repair_at": "20.mid@0:3", "ntp.fail_at": "10@0:3"}, "ntp.repair_at"),
    ({"ntp.recovery": "pray"}, "ntp.recovery"),
])
def test_bad_events_are_one_line_errors_before_training(overrides, field, tmp_path):
  config = micro_config(tmp_path, **{"train.steps": 40, **MESH, **overrides})
  with pytest.raises(ConfigError, match=f"^{field}:") as err:
    train(config, **QUIET)
  assert "\n" not in str(err.value)
  assert not os.path.exists(tmp_path / "metrics.jsonl")  # nothing started


def test_one_replica_has_no_peer_and_falls_back_to_the_checkpoint(workdir, tmp_path):
  logged = []
  config = micro_config(workdir, **{"train.steps": 8, "mesh.tp": 4, "ntp.fail_at": "6@0:3"})
  config.checkpoint.every = 4
  config.checkpoint.dir = str(tmp_path)
  result = train(config, log=logged.append)
  assert any("live recovery impossible" in line for line in logged), logged[-10:]
  assert result.redone_steps == 2  # steps 4 and 5, after the checkpoint of step 4
  steps = [r["step"] for r in read_metrics(result.metrics_path)]
  assert steps == list(range(8))
  assert np.isfinite(result.losses).all()


def test_proportional_shares_equal_a_single_device_fed_the_same_sequences(workdir, tmp_path):
  """The global batch shrinks to 14 sequences while a slot is down, then returns to 16."""
  from flax import nnx

  from models.gpt import GPT, GPTConfig, model_layouts
  from ntp_jax.data import make_dataset
  from ntp_jax.parallel.plan import make_plan
  from ntp_jax.parallel.programs import ProgramCache, build_class_programs, logical_state
  from ntp_jax.parallel.step_modes import make_job_step
  from ntp_jax.state.sources import ArraySource
  from ntp_jax.training.optim import make_optimizer

  events = {"ntp.rebalance": "proportional", "ntp.fail_at": "4@0:3", "ntp.repair_at": "8@0:3"}
  ntp = run(workdir, tmp_path, **events)
  records = read_metrics(ntp.metrics_path)
  batches = [r["global_batch"] for r in records]
  assert batches == [16] * 4 + [14] * 4 + [16] * 4

  config = micro_config(workdir, **{"train.steps": 12})
  cfg = GPTConfig.from_config(config.model)
  optimizer = make_optimizer(config.train)
  dataset = make_dataset(None, cfg.vocab_size, config.train.seq_len, str(workdir),
                         config.train.seed, max_corpus_bytes=config.data.max_corpus_bytes,
                         val_fraction=config.data.val_fraction)
  losses, cursor, programs, source = [], 0, None, None
  cache = ProgramCache()  # the batch of 16 again: its step compiled once
  for batch in batches:
    if programs is None or batch != programs[0].replica_class.batch_share:
      if programs is not None:
        source = ArraySource({p: np.asarray(a) for p, a in logical_state(programs).items()})
      plan = make_plan(functools.partial(model_layouts, cfg), tp=1, dp=1, batch_size=batch)
      programs = build_class_programs(
          plan, lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(config.train.seed)), optimizer,
          config.train.clip_norm, batch * config.train.seq_len, jax.devices()[:1], source=source,
          cache=cache)
      job = make_job_step(plan, programs, cache=cache)
    losses.append(float(job(dataset.sequences(cursor, batch))["loss"]))
    cursor += batch
  np.testing.assert_allclose(ntp.losses, losses, rtol=1e-4)
