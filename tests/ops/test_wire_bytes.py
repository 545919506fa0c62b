"""What crosses the wire: collectives read from compiled HLO, one all-reduce per block input,
none over a group of one device."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from helpers import SEQ, SMALL
from jax.sharding import PartitionSpec as P
from layer_check import mesh_for

from models.gpt import GPT, model_layouts
from ntp_jax.analysis.hlo_collectives import Collective, collectives, totals
from ntp_jax.layers import Attention, SwiGLU, rope_angles
from ntp_jax.layers.shard import tp_function
from ntp_jax.parallel.plan import make_plan
from ntp_jax.parallel.steps import FusedStep, StepSettings
from ntp_jax.sharding.layout import make_layout
from ntp_jax.training.footprint import abstract_program

# Lines of an optimized HLO module, in the forms XLA prints (CPU, and GPU's asynchronous start).
HLO = "\n".join([
    "  %all-reduce.1 = f32[16,256,512]{2,1,0} all-reduce(f32[16,256,512]{2,1,0} %x), "
    "channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add",
    "  %psum.2 = (f32[4]{0}, bf16[2,3]{1,0}) all-reduce(f32[4]{0} %a, bf16[2,3]{1,0} %b), "
    "replica_groups={{0},{1}}, to_apply=%add",
    "  %ars = f32[8]{0} all-reduce-start(f32[8]{0} %c), replica_groups=[2,4]<=[8], to_apply=%add",
    "  %ard = f32[8]{0} all-reduce-done(f32[8]{0} %ars)",
    "  %ag = f32[2,6]{1,0} all-gather(f32[2,3]{1,0} %d), replica_groups=[4,2]<=[8], dimensions={1}",
    "  %cp = s32[5]{0} collective-permute(s32[5]{0} %e), source_target_pairs={{0,1},{1,0}}",
    "  %cp.self = s32[5]{0} collective-permute(s32[5]{0} %e), source_target_pairs={{0,0},{1,1}}",
    "  %dot = f32[4,4]{1,0} dot(f32[4,4]{1,0} %p, f32[4,4]{1,0} %q)",
    # A start's tuple holds its operand too: the bytes are the done's result.
    "  %ags = (f32[2,3]{1,0}, f32[2,6]{1,0}) all-gather-start(f32[2,3]{1,0} %d), "
    "replica_groups=[4,2]<=[8], dimensions={1}",
    "  %agd = f32[2,6]{1,0} all-gather-done((f32[2,3]{1,0}, f32[2,6]{1,0}) %ags)",
])


def test_collectives_are_read_with_their_bytes_and_group_sizes():
  assert collectives(HLO) == [
      Collective("all-reduce", 16 * 256 * 512 * 4, 8),
      Collective("all-reduce", 4 * 4 + 6 * 2, 1),  # a tuple: both elements counted
      Collective("all-reduce", 32, 4),  # the asynchronous start, its done not counted again
      Collective("all-gather", 48, 2),
      Collective("collective-permute", 20, 2),
      Collective("collective-permute", 20, 1),
      Collective("all-gather", 48, 2),
  ]
  found = totals(collectives(HLO))
  assert found.ops == {"all-reduce": 3, "all-gather": 2, "collective-permute": 2}
  assert (found.singleton_ops, found.singleton_bytes) == (2, 28 + 20)


def _layer_all_reduce(layer, mesh, x, fn):
  """All-reduce bytes and totals of the layer's forward and backward (input and weights)."""
  graphdef, state = nnx.split(layer)
  run = tp_function(graphdef, state, fn, mesh, (P(),), P())
  grad = jax.jit(jax.grad(lambda s, x: jnp.sum(run(s, x) ** 2), argnums=(0, 1)))
  found = totals(collectives(grad.lower(state, x).compile().as_text()))
  return found.bytes.get("all-reduce", 0), found


def _attention_fn(m, x):
  cos, sin = rope_angles(jnp.arange(x.shape[1])[None], 4, 1e4)
  return m(x, cos, sin)


@pytest.mark.parametrize("block", ["attention", "mlp"])
def test_one_all_reduce_per_block_input_forward_and_backward(block):
  """The forward all-reduce of the output and one backward all-reduce of the input gradient
  (q, k and v, or gate and up, summed on each device first): twice the activation's bytes."""
  layout = make_layout(8, 4)
  x = jnp.ones((2, 5, 12))
  if block == "attention":
    layer, fn = Attention(12, 16, 4, layout, rngs=nnx.Rngs(0)), _attention_fn
  else:
    layer, fn = SwiGLU(12, make_layout(8, 4, unit_size=3), rngs=nnx.Rngs(0)), None
  wire, found = _layer_all_reduce(layer, mesh_for(layout), x, fn or (lambda m, x: m(x)))
  assert wire == 2 * x.size * 4, found
  assert found.singleton_ops == 0


def _fused_step_hlo(tp, failed=()):
  plan = make_plan(functools.partial(model_layouts, SMALL), tp=tp, dp=1, failed=failed,
                   batch_size=4)
  optimizer = optax.adamw(1e-3)
  program, batch = abstract_program(plan, plan.classes[0],
                                    lambda layouts: GPT(SMALL, layouts, rngs=nnx.Rngs(0)),
                                    optimizer, SEQ, jax.devices()[:tp])
  step = FusedStep.build(program.graphdef, program.params, program.opt_state, program.mesh,
                         StepSettings(optimizer, 1.0, plan.global_batch * SEQ))
  [lowered] = step.lower(program.params, program.opt_state, batch)
  return lowered.compile().as_text()


@pytest.mark.parametrize("failed", [(), ((0, 1),)])
def test_a_lone_replica_runs_no_collective_over_one_device(failed):
  """dp=1: no DP all-reduce of the gradients or the loss over a group of one."""
  found = totals(collectives(_fused_step_hlo(4, failed)))
  assert found.ops.get("all-reduce", 0) > 0
  assert (found.singleton_ops, found.singleton_bytes) == (0, 0)
