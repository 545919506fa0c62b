"""The sharded optimizer (``train.optimizer_sharding=zero1``) against the replicated one.

Each run trains gpt_tiny and writes its last step as a logical checkpoint, which holds the
optimizer state in the class layout a replicated run keeps: parameters and Adam moments
are compared there, leaf by leaf.
"""

import jax
import numpy as np
import pytest
from helpers import tiny_config

from ntp_jax.state.checkpoint import Checkpoints
from ntp_jax.training.trainer import train

QUIET = dict(log=lambda *_: None)
STEPS = 20


def run(tmp_path, name, **overrides):
  config = tiny_config(tmp_path / name, **{"train.steps": STEPS, "mesh.dp": 2, "mesh.tp": 4,
                                           **overrides})
  config.checkpoint.every = STEPS
  return train(config, **QUIET), tmp_path / name / "checkpoints"


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


def assert_same_state(got, want, rtol):
  assert got.keys() == want.keys()
  for path in want:
    scale = np.max(np.abs(want[path])) if want[path].size else 0.0
    np.testing.assert_allclose(got[path], want[path], rtol=rtol, atol=rtol * scale,
                               err_msg="/".join(map(str, path)))


@pytest.mark.parametrize("failed", ["", "1:3"], ids=["degrees-4-4", "degrees-4-3"])
def test_zero1_trains_as_the_replicated_optimizer(tmp_path, failed):
  """dp=2 tp=4, healthy (one class) and with a degree-3 replica (two classes, sync at
  t_min=3): one copy (two pieces) and two copies (one piece held twice)."""
  base, base_dir = run(tmp_path, "replicated", **{"ntp.failed": failed})
  want = stored(base_dir)
  for copies in (1, 2):
    result, folder = run(tmp_path, f"zero1-{copies}", **{
        "ntp.failed": failed, "train.optimizer_sharding": "zero1",
        "train.optimizer_copies": copies})
    np.testing.assert_allclose(result.losses, base.losses, rtol=1e-6)
    assert_same_state(stored(folder), want, rtol=1e-6)
