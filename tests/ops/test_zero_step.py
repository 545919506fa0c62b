"""The sharded optimizer's step (``parallel.zero``) against the replicated optimizer's, on the
uneven SMALL model: the same loss, norm and Adam moments after a step, the class layout's
state given back exactly, each piece from a live copy, and no live copy said in one line."""

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import SEQ, SMALL, assert_trees_close, global_batch

from models.gpt import GPT, model_layouts
from ntp_jax.parallel.plan import make_plan
from ntp_jax.parallel.programs import build_class_programs, keep_rows
from ntp_jax.parallel.step_modes import make_job_step
from ntp_jax.parallel.zero import ZeroSettings, moment_fields, piece_count
from ntp_jax.training.config import parse_failed
from ntp_jax.training.optim import decay_mask

CLIP = 0.5  # below the first steps' norms: the clip's scale is part of what is compared


def adamw(masked=True):
  return optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask if masked else None)


def lion(masked=True):  # one moment, and a step count
  return optax.lion(1e-3, weight_decay=0.1, mask=decay_mask if masked else None)


def momentum(masked=True):  # a trace, and no step count
  return optax.sgd(0.1, momentum=0.9)


def job(tp, dp, failed="", copies=None, rebalance="equal", stage=1, batch_size=None,
        microbatches=1, optimizer=adamw):
  """A JobStep on SMALL (split halves); ``copies``: the sharded optimizer with that many
  copies (``stage`` 1 or 2), None: replicated. ``optimizer(masked)``: the optax rule (the
  sharded optimizer's without the decay mask, which it applies per element)."""
  plan = make_plan(functools.partial(model_layouts, SMALL), tp=tp, dp=dp,
                   failed=parse_failed(failed, dp, tp), batch_size=batch_size or 2 * dp,
                   rebalance=rebalance, microbatches=microbatches)
  programs = build_class_programs(plan, lambda layouts: GPT(SMALL, layouts, rngs=nnx.Rngs(0)),
                                  optimizer(), CLIP, plan.global_batch * SEQ,
                                  jax.devices()[:tp * dp], split=True)
  zero = None if copies is None else ZeroSettings(optimizer(masked=False), decay_mask, CLIP,
                                                  copies, stage=stage)
  return make_job_step(plan, programs, split=True, zero=zero)


def steps(step, n):
  return [step(global_batch(step.plan.global_batch, i)) for i in range(n)]


def class_states(step):
  return [jax.tree.map(np.asarray, (p.params, p.opt_state)) for p in step.class_programs()]


def spoil(array, dead):
  """``array`` with NaN on the ``dead`` devices (a read of them would show)."""
  if not array.ndim:
    return array
  shards = [jax.device_put(np.full(s.data.shape, np.nan, s.data.dtype), s.device)
            if s.device in dead else s.data for s in array.addressable_shards]
  return jax.make_array_from_single_device_arrays(array.shape, array.sharding, shards)


def near_in_norm(got, want, tolerance):
  """``got`` within ``tolerance`` of ``want``'s norm (equal when that is 0)."""
  error = np.linalg.norm(np.ravel(got - want))
  assert error <= tolerance * np.linalg.norm(np.ravel(want)), (error, np.linalg.norm(want))


def test_piece_count_keeps_the_copies():
  assert [piece_count(4, k) for k in (1, 2, 3, 4)] == [4, 2, 1, 1]
  assert [piece_count(3, k) for k in (1, 2, 3)] == [3, 1, 1]
  with pytest.raises(ValueError, match="3 copies"):
    piece_count(2, 3)


@pytest.fixture(scope="module")
def replicated_4_3():
  """The replicated step on degrees 4 and 3 (``job(4, 2, "1:3")``), the reference of every copy
  count below, run once: its first step's loss and norm, the class states after that step,
  and its second step's loss."""
  replicated = job(4, 2, "1:3")
  first = steps(replicated, 1)[0]
  first = {k: float(first[k]) for k in ("loss", "grad_norm")}
  states = class_states(replicated)
  return first, states, float(replicated(global_batch(4, 1))["loss"])


@pytest.mark.parametrize("copies", [1, 2])
def test_a_sharded_step_gives_the_replicated_loss_norm_and_moments(copies, replicated_4_3):
  """Degrees 4 and 3 (two classes, t_min 3), one step from the same state: the moments are
  the clipped gradient and its square, so they are compared tightly; the parameters after
  Adam's division (which amplifies rounding in near-zero entries) and a second step's loss
  less so."""
  a, states, second = replicated_4_3
  sharded = job(4, 2, "1:3", copies)
  assert sharded.zero.pieces == 2 // copies
  b = steps(sharded, 1)[0]
  np.testing.assert_allclose(float(b["loss"]), a["loss"], rtol=1e-6)
  np.testing.assert_allclose(float(b["grad_norm"]), a["grad_norm"], rtol=1e-6)
  assert a["grad_norm"] > CLIP
  assert all(p.opt_state is None for p in sharded.programs)  # held as pieces between steps
  for (params_a, opt_a), (params_b, opt_b) in zip(states, class_states(sharded)):
    assert_trees_close(opt_b, opt_a, rtol=1e-6, atol=1e-13)
    assert_trees_close(params_b, params_a, rtol=1e-5, atol=1e-7)
  b = sharded(global_batch(4, 1))
  np.testing.assert_allclose(float(b["loss"]), second, rtol=1e-6)


@pytest.mark.parametrize("microbatches, counts", [(4, [4, 3]), (2, [2, 2])])
def test_a_zero2_step_reduces_each_micro_batch_and_gives_the_replicated_step(microbatches,
                                                                            counts):
  """zero2, degrees 4 and 3 with proportional shares of 4 and 3 rows: in 1-row micro-batches
  (4 and 3 of them: the degree-3 class adds zeros in the last round), and in 2-row ones (its
  3 rows as 2 + 1: two sizes); loss, norm and moments as the replicated step's."""
  kwargs = dict(failed="1:3", rebalance="proportional", batch_size=8,
                microbatches=microbatches)
  replicated, sharded = job(4, 2, **kwargs), job(4, 2, copies=1, stage=2, **kwargs)
  assert [c.microbatches for c in sharded.plan.classes] == counts
  a, b = steps(replicated, 1)[0], steps(sharded, 1)[0]
  np.testing.assert_allclose(float(b["loss"]), float(a["loss"]), rtol=1e-6)
  np.testing.assert_allclose(float(b["grad_norm"]), float(a["grad_norm"]), rtol=1e-6)
  assert float(a["grad_norm"]) > CLIP
  # The micro-batches are summed across replicas first, then over the rounds: entries that
  # cancel round differently, so each leaf is compared against its norm (the parameters,
  # after Adam's division, as in the test above).
  for (params_a, opt_a), (params_b, opt_b) in zip(class_states(replicated),
                                                  class_states(sharded)):
    jax.tree.map(lambda x, y: near_in_norm(x, y, 1e-6), opt_b, opt_a)
    jax.tree.map(lambda x, y: near_in_norm(x, y, 1e-5), params_b, params_a)
  a, b = replicated(global_batch(8, 1)), sharded(global_batch(8, 1))
  np.testing.assert_allclose(float(b["loss"]), float(a["loss"]), rtol=1e-6)


@pytest.mark.parametrize("optimizer", [lion, momentum], ids=["lion", "sgd-momentum"])
def test_any_optax_rule_with_parameter_shaped_state_is_sharded_as_it_is(optimizer):
  """The sharded update applies the configured optax rule to the pieces: Lion (one moment
  ``mu``, a count, decoupled decay) and SGD with momentum (a ``trace``, no count) give the
  replicated step's loss, state and parameters over two steps on degrees 4 and 3."""
  replicated, sharded = (job(4, 2, "1:3", copies, optimizer=optimizer) for copies in (None, 1))
  fields = {"lion": ("mu",), "momentum": ("trace",)}[optimizer.__name__]
  assert sharded.zero.fields == fields
  for a, b in zip(steps(replicated, 2), steps(sharded, 2)):
    np.testing.assert_allclose(float(b["loss"]), float(a["loss"]), rtol=1e-6)
  for (params_a, opt_a), (params_b, opt_b) in zip(class_states(replicated),
                                                  class_states(sharded)):
    jax.tree.map(lambda x, y: near_in_norm(x, y, 1e-6), opt_b, opt_a)
    jax.tree.map(lambda x, y: near_in_norm(x, y, 1e-5), params_b, params_a)


def test_a_state_the_pieces_cannot_hold_is_one_line():
  """Adafactor's factored second moment is not shaped as the parameters: refused, naming it."""
  with pytest.raises(ValueError, match=r"^optimizer state leaf state.*is neither shaped as "
                                       r"the parameters nor a scalar"):
    moment_fields(optax.adafactor(1e-2, min_dim_size_to_factor=2))


def test_the_class_layout_state_comes_back_exactly_and_from_live_copies():
  """dp=4 tp=2, two copies of each of two pieces: the state given back, sharded again and
  given back is bit for bit the same; with the devices of replica 0 failed, each of their
  pieces is read from replica 2 and the result is the same again."""
  step = job(2, 4, copies=2)
  assert step.zero.pieces == 2
  steps(step, 2)
  first = class_states(step)
  again = make_job_step(step.plan, step.class_programs(), split=True, zero=step.zero.settings)
  dead = set(step.programs[0].mesh.devices[0])
  again.zero_state = jax.tree.map(lambda x: spoil(x, dead), again.zero_state)
  second = [jax.tree.map(np.asarray, (p.params, p.opt_state))
            for p in again.class_programs(dead)]
  jax.tree.map(np.testing.assert_array_equal, second, first)


def test_fewer_live_replicas_than_copies_hold_every_piece_each():
  """Two copies asked for, one replica left (the other dropped): it holds the whole state."""
  step = job(2, 2, "0:0,0:1", copies=2)
  assert len(step.plan.replicas) == 1 and step.zero.pieces == 1
  assert np.isfinite(float(steps(step, 1)[0]["loss"]))


def test_a_piece_with_no_live_copy_is_one_line():
  step = job(2, 4, copies=1)
  steps(step, 1)
  with pytest.raises(LookupError, match=r"piece 1 of peer group 0 was held by failed "
                                         r"devices only \(train.optimizer_copies=1\)"):
    step.class_programs({step.programs[0].mesh.devices[1, 0]})


def survivors_of(step, dropped):
  """The class programs of ``step`` without the replicas ``dropped`` (as a lost process
  leaves them), and the dropped replicas' devices."""
  out, dead = [], set()
  for program in step.programs:
    replicas = program.replica_class.replicas
    rows = [i for i, r in enumerate(replicas) if r not in dropped]
    dead |= {d for i, r in enumerate(replicas) if r in dropped
             for d in program.mesh.devices[i]}
    cut = keep_rows(program, rows)
    if cut is not None:
      out.append(cut)
  return out, dead


def test_the_survivors_of_a_lost_replica_read_the_state_back_exactly():
  """dp=4 tp=2 with replica 3 at degree 1 (two classes, t_min 1, so slot 1 of the degree-2
  replicas lies past the core), two copies of two pieces: with replica 0 gone (its devices
  spoiled), the survivors read the state back among themselves, piece 0 from replica 2,
  bit for bit the rows of the state the whole plan gives back."""
  step = job(2, 4, "3:1", copies=2)
  assert step.zero.pieces == 2 and len(step.plan.classes) == 2
  steps(step, 2)
  whole = class_states(step)
  survivors, dead = survivors_of(step, {0})
  step.zero_state = jax.tree.map(lambda x: spoil(x, dead), step.zero_state)
  lowered = step.lower_read_back_by_survivors(survivors, dead)()
  assert [what for what, _, _ in lowered].count(
      "optimizer state read back by survivors (unpack)") == 2
  survivors = step.class_programs(dead, lost=dead, survivors=survivors)
  rows = [[1, 2], [0]]  # class 0 keeps replicas 1 and 2, class 1 replica 3
  for survivor, (_, opt), kept in zip(survivors, whole, rows):
    want = jax.tree.map(lambda x, kept=kept: x[kept] if x.ndim else x, opt)
    jax.tree.map(np.testing.assert_array_equal,
                 jax.tree.map(np.asarray, survivor.opt_state), want)


def test_survivors_missing_a_piece_are_one_line():
  """Replicas 0 and 2 (both copies of piece 0) gone: the restart path, said in one line;
  nothing is lowered ahead for it."""
  step = job(2, 4, copies=2)
  steps(step, 1)
  survivors, dead = survivors_of(step, {0, 2})
  assert step.lower_read_back_by_survivors(survivors, dead)() == []
  with pytest.raises(LookupError, match=r"^optimizer state piece 0 \(of every peer group\) "
                                         r"was held only by replicas of lost processes "
                                         r"\(train.optimizer_copies=2\)$"):
    step.class_programs(dead, lost=dead, survivors=survivors)
