"""The sharded optimizers (``train.optimizer_sharding=zero1``, ``zero2``) in whole runs,
against the replicated one: training, checkpoints in both directions, live recovery from copies.

A run's last step is written as a logical checkpoint, which holds the optimizer state in
the layout a replicated run keeps, so parameters and Adam moments are compared there,
leaf by leaf. Over 20 AdamW steps rounding differs between any two programs that sum in
another order (Adam divides each entry by its own magnitude): the replicated optimizer's
own split and fused steps differ by 2.3e-6 of a leaf's norm after 20 steps here, so
states are compared at 1e-5 of each leaf's norm, losses at 1e-6.
"""

import jax
import numpy as np
import pytest
from helpers import WaitForAhead, micro_config

from ntp_jax.model import load_model_spec
from ntp_jax.parallel.programs import build_class_programs, logical_state
from ntp_jax.parallel.step_modes import make_job_step
from ntp_jax.state.checkpoint import Checkpoints
from ntp_jax.training.config import RunConfig
from ntp_jax.training.loop import plan_for
from ntp_jax.training.metrics import read_records
from ntp_jax.training.optim import make_optimizer, zero_settings
from ntp_jax.training.trainer import train

QUIET = dict(log=lambda *_: None)
STEPS = 20
ZERO = {"train.optimizer_sharding": "zero1"}


def config_of(folder, steps=STEPS, **overrides):
  config = micro_config(folder, **{"train.steps": steps, "mesh.dp": 2, "mesh.tp": 4,
                                  **overrides})
  config.checkpoint.every = steps
  return config


def run(folder, steps=STEPS, log=None, **overrides):
  result = train(config_of(folder, steps, **overrides), **(QUIET if log is None else
                                                           dict(log=log)))
  return result, folder / "checkpoints"


def stored(folder, step=STEPS):
  """``path -> numpy array`` of every logical array of a checkpoint, read on one device."""
  checkpoints = Checkpoints(str(folder), reads_only=True)
  try:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    requests = {path: jax.ShapeDtypeStruct(shape, dtype, sharding=one)
                for path, (shape, dtype) in checkpoints.shapes(step).items()}
    return {path: np.asarray(x) for path, x in checkpoints.restore(step, requests).items()}
  finally:
    checkpoints.close()


def assert_same_state(got, want, tolerance=1e-5):
  """Every leaf within ``tolerance`` of its norm; the step counts equal."""
  assert got.keys() == want.keys()
  for path in want:
    name = "/".join(map(str, path))
    if want[path].dtype.kind == "i":
      np.testing.assert_array_equal(got[path], want[path], err_msg=name)
      continue
    error = np.linalg.norm((got[path] - want[path]).ravel())
    assert error <= tolerance * np.linalg.norm(want[path].ravel()), name


@pytest.mark.parametrize("failed, choices", [
    ("", [("zero1", 1), ("zero2", 2)]),
    ("1:3", [("zero1", 2), ("zero2", 1)])],
    ids=["degrees-4-4", "degrees-4-3"])
def test_sharded_optimizers_train_as_the_replicated_one(tmp_path, failed, choices):
  """dp=2 tp=4, healthy (one class) and with a degree-3 replica (two classes, synced at
  t_min=3), two micro-batches a step (the degree-3 replica's 7 rows as 4 + 3): one copy
  (two pieces) and two copies (one piece held twice); each sharding with each copy count
  once over the two plans."""
  micro = {"ntp.failed": failed, "train.microbatches": 2}
  base, base_dir = run(tmp_path / "replicated", **micro)
  want = stored(base_dir)
  for sharding, copies in choices:
    result, folder = run(tmp_path / f"{sharding}-{copies}", **micro, **{
        "train.optimizer_sharding": sharding, "train.optimizer_copies": copies})
    np.testing.assert_allclose(result.losses, base.losses, rtol=1e-6, err_msg=sharding)
    assert_same_state(stored(folder), want)
    assert all(p.opt_state is not None for p in result.programs)  # the class layout's back


def test_a_zero1_checkpoint_restores_onto_a_replicated_plan_and_back_exactly(tmp_path):
  """Written by zero1 on 2 x 4; placed onto a replicated plan with a degree-3 replica and
  onto zero1 plans (its pieces made and given back), each read back bit for bit."""
  _, folder = run(tmp_path / "zero1", steps=4, **ZERO)
  want = stored(folder, 4)
  checkpoints = Checkpoints(str(folder), reads_only=True)
  try:
    for failed, sharding in (("1:3", "replicated"), ("1:3", "zero1"), ("", "zero1")):
      config = RunConfig.from_config(config_of(tmp_path / "read", 4, **{
          "ntp.failed": failed, "train.optimizer_sharding": sharding}))
      model = load_model_spec(config.model.factory, config.source)
      plan = plan_for(config, model, config.ntp.failed)
      zero = zero_settings(config.train)
      programs = build_class_programs(plan, model.make, make_optimizer(config.train),
                                      config.train.clip_norm, plan.global_batch,
                                      jax.devices(), source=checkpoints.source(4),
                                      split=zero is not None)
      step = make_job_step(plan, programs, split=zero is not None, zero=zero)
      got = {path: np.asarray(x) for path, x in logical_state(step.class_programs()).items()}
      assert got.keys() == want.keys()
      for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=f"{failed} {sharding}")
  finally:
    checkpoints.close()


def test_bfloat16_parameters_resume_exactly_from_float32_master_weights(tmp_path):
  """zero1 on 2 x 2 with bfloat16 parameters: the checkpoint holds the float32 master
  weights and moments of the sharded state, so 4 steps and 4 more resumed are the 8-step
  run bit for bit (the parameters alone would round the master weights to bfloat16)."""
  bf16 = {**ZERO, "mesh.tp": 2, "model.param_dtype": "bfloat16", "model.dtype": "bfloat16",
          "train.schedule_steps": 8}
  whole, whole_dir = run(tmp_path / "whole", steps=8, **bf16)
  first, parts_dir = run(tmp_path / "parts", steps=4, **bf16)
  second, _ = run(tmp_path / "parts", steps=8, **bf16)
  assert second.start_step == 4 and first.losses + second.losses == whole.losses
  want, got = stored(whole_dir, 8), stored(parts_dir, 8)
  assert got.keys() == want.keys()
  for path in want:
    np.testing.assert_array_equal(got[path], want[path], err_msg="/".join(path))
  kinds = {(path[0], "master" in path): str(x.dtype) for path, x in want.items()
           if x.dtype.kind not in "iu"}  # bfloat16 is kind "V" in numpy
  assert kinds == {("params", False): "bfloat16", ("opt_state", True): "float32",
                   ("opt_state", False): "float32"}


# dp=4 tp=2: replica 0 loses slot 1 at step 4 (degrees [1, 2, 2, 2], t_min 1, two pieces
# with two copies), replica 3 loses both slots at step 7 (dropped; three replicas).
EVENTS = {"mesh.dp": 4, "mesh.tp": 2, "ntp.fail_at": "4@0:1,7@3:0,7@3:1",
          "ntp.recovery": "live"}


def test_two_copies_recover_live_from_the_copies(tmp_path):
  """zero2 (zero1's live recovery from copies is the multi-process test's: a lost
  process's pieces rebuilt from the copies). Two copies of two pieces on four replicas:
  each round's reduction is two programs, a reduce-scatter over each copy's replicas and a
  sum over the copies (``ShardedOptimizer.reduce_in_two``; one grouping of the devices per
  program: ``test_footprint``), and the losses are the replicated run's."""
  sharding = "zero2"
  replicated_with_events = run(tmp_path / "replicated", steps=10, **EVENTS)[0].losses
  lines = []
  result, _ = run(tmp_path / sharding, steps=10, log=lines.append, **EVENTS,
                  **{"train.optimizer_sharding": sharding, "train.optimizer_copies": 2})
  np.testing.assert_allclose(result.losses, replicated_with_events, rtol=1e-5)
  assert "optimizer state: zero2, 2 piece(s) per peer group, each held by 2 replica(s) " \
         "(train.optimizer_copies=2)" in lines, lines[:5]
  assert sum("live: state moved from DP peers" in line for line in lines) == 2
  assert not any("restor" in line for line in lines)


def test_sharded_recoveries_compiled_ahead_compile_nothing(tmp_path):
  """dp=2 tp=2, zero2 with two copies, two micro-batches, bfloat16 parameters: a failure, a
  second one in the other replica and a repair, each onto a plan compiled in the background
  before it came (the sharded optimizer's programs and the read-back of its state included:
  each micro-batch size's gradient half and the reductions, the float32 master weights'
  packing and read-back). zero1's programs are zero2's with one reduction a step; one case
  compiles both kinds' parts (a second case cost 45 s of the suite)."""
  sharding, microbatches, dtype = "zero2", 2, "bfloat16"
  steps = {3, 5, 7}
  config = config_of(tmp_path / "ahead", 9, **{
      "model.param_dtype": dtype, "model.dtype": dtype,
      "train.optimizer_sharding": sharding, "train.microbatches": microbatches,
      "mesh.dp": 2, "mesh.tp": 2, "train.optimizer_copies": 2, "ntp.precompile": "next_failure",
      "ntp.fail_at": "3@0:1,5@1:0", "ntp.repair_at": "7@0:1"})
  config.checkpoint.every = 0
  result = train(config, hooks=[WaitForAhead(steps)], **QUIET)
  records = read_records(result.metrics_path)
  start = next(r for r in records if r.get("event") == "start")
  assert (start["optimizer_sharding"], start["optimizer_copies"]) == (sharding, 2)
  rows = [r for r in records if r.get("event") == "recovered"]
  assert [(r["step"], r["path"]) for r in rows] == [(3, "live"), (5, "live"), (7, "live")]
  assert all(r["compiled_ahead"] and r["compile_s"] == 0.0 for r in rows), rows
