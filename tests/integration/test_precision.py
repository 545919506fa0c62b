"""Mixed precision: fp32 master parameters and Adam moments, bf16 compute, fp32 loss."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import tiny_config

from ntp_jax.train.trainer import train


def test_bf16_compute_tracks_fp32_over_150_steps(tmp_path):
  # One device: precision is the point here; the TP paths are the same code in bf16.
  runs = {}
  for dtype in ("float32", "bfloat16"):
    config = tiny_config(tmp_path, **{"train.steps": 150, "mesh.tp": 1, "model.dtype": dtype,
                                      "train.log_every": 50})
    runs[dtype] = train(config, log=lambda *_: None)
  fp32, bf16 = (np.asarray(runs[d].losses) for d in ("float32", "bfloat16"))
  assert len(bf16) == 150 and np.all(np.isfinite(bf16))
  assert not np.array_equal(fp32, bf16)  # the bf16 run really computed in bf16
  assert abs(bf16[-1] - fp32[-1]) / fp32[-1] < 0.02, (bf16[-1], fp32[-1])
  assert bf16[-1] < 0.6 * bf16[0]  # and it learned

  program = runs["bfloat16"].programs[0]
  assert {x.dtype for x in jax.tree.leaves(program.params)} == {jnp.dtype(jnp.float32)}
  moments = [x for x in jax.tree.leaves(program.opt_state) if x.ndim > 0]
  assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
  batch = jax.ShapeDtypeStruct((16, 65), np.int32, sharding=program.batch_sharding)
  [lowered] = program.step.lower(program.params, program.opt_state, batch)
  hlo = lowered.as_text()
  assert "bf16" in hlo
