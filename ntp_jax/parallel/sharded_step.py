"""The job's step with the optimizer state sharded over the peer groups (``zero``).

Each class's gradient half (zero2: per micro-batch) leaves its gradients in sync buffers;
``zero.ShardedOptimizer`` reduces them into the pieces, updates the pieces (no collective)
and gathers the new parameters, which each class unpacks. The class programs'
``opt_state`` moves into the step's sharded state (and is None there from then on);
``class_programs`` gives the training state back in the class layout, as a value.

Where steps commit (``processes.commit``), each phase of collectives is voted on before
the next; the update runs once every live process voted that the reduction ended well,
so every survivor updates its pieces or none does. From then on the pieces are the state:
a process lost while the parameters are gathered or unpacked leaves the step applied,
the loss waiting (``take_pending_loss``) and the parameters rebuilt from the master
weights' pieces (``params_behind``; ``class_programs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ntp_jax.parallel.accumulate import micro_starts
from ntp_jax.parallel.job_step import Commit, SyncedJobStep, voted
from ntp_jax.parallel.metrics_handoff import hand_off, handoff_classes
from ntp_jax.parallel.plan import Plan
from ntp_jax.parallel.programs import ClassProgram, ProgramCache, class_batch, class_label
from ntp_jax.parallel.zero import ZeroSettings, cached_sharded_optimizer, runs_of, step_count
from ntp_jax.parallel.zero_survivors import SurvivorRebuild
from ntp_jax.processes.arrival import ProcessLost
from ntp_jax.sharding.topology import mine


class ShardedJobStep(SyncedJobStep):
  """The job's step with a sharded optimizer state (see the module docstring).

  Args:
    plan, programs, cache, before_sync: as for ``SyncedJobStep`` (the programs built
      split).
    zero: the sharded optimizer's settings (``zero.ZeroSettings``).
    commit: steps that commit (``job_step.CommittedJobStep``'s ``commit``), or None: the
      phases run without votes.
  """

  def __init__(self, plan: Plan, programs: list[ClassProgram],
               cache: ProgramCache | None = None, *,
               before_sync: Callable[[], None] | None = None, zero: ZeroSettings,
               commit: Commit | None = None):
    super().__init__(plan, programs, cache, before_sync=before_sync)
    self.commit = commit
    self.pending_loss: ProcessLost | None = None  # lost after a committed update
    self.params_behind = False  # the parameters are a step behind the pieces
    first = self.first_local
    self.zero_key, self.zero = cached_sharded_optimizer(
        self.cache, self.sync_key, self.sync, zero, runs_of(first.step.leaves, zero,
                                                              first.params))
    # What the class layout's state looks like, to give it back (checkpoints, live peers).
    self.opt_shapes = [jax.tree.map(_abstract, p.opt_state) for p in programs]
    # The optimizer's step count on the host: every process knows it, core device or not.
    count = step_count(first.opt_state)
    self.zero_count = 0 if count is None else int(np.asarray(count))
    self.zero_state = self.zero.start(programs)
    # Classes holding a device of a process with no core device: the sharded update's
    # metrics reach that process through a program over the class mesh.
    self.handoff = handoff_classes([p.mesh for p in programs], self.sync.mesh)

  @property
  def keys(self) -> list:
    """The ``ProgramCache`` keys of every program this step runs (the sharded optimizer's
    in place of the all-reduce)."""
    return [p.key for p in self.programs if p.key is not None] + [self.zero_key]

  def __call__(self, batch: Any) -> dict[str, np.ndarray]:
    """The gradients reduced into the pieces, their norm, the update of the pieces, and each
    class's parameters unpacked from the gathered buffers (see the module docstring).
    Returns the job's ``loss`` and ``grad_norm`` (f32 numpy scalars, read here)."""
    pieces, sums, templates = self._reduced(batch)
    metrics = self._phase("norm", lambda: self.zero.norm(sums))
    norm = None if metrics is None else metrics["grad_norm"]
    if self.handoff:  # the processes with no core device take the metrics from their class
      metrics = self._phase("metrics", lambda: self._handed_off(metrics))
    self.zero_state = self.zero.update(pieces, norm, self.zero_state)
    self.zero_count += 1
    self.params_behind = True
    try:
      full = self._phase("gather", lambda: self.zero.gather_params(self.zero_state, templates))
      params = self._phase("unpack", lambda: [
          program.step.unpack(buffers, program.params) if local else None
          for program, local, buffers in zip(self.programs, self.local, full)])
    except ProcessLost as lost:  # the update stands: the parameters come from the pieces
      self.pending_loss = lost
      for program, local in zip(self.programs, self.local):
        if local:  # donated to an unpacking that did not commit: shapes for the rebuild
          program.params = jax.tree.map(_renewed, program.params)
      return _read(metrics)
    for program, local, new in zip(self.programs, self.local, params):
      if local:
        program.params = new
    self.params_behind = False
    return _read(metrics)  # once the rest is dispatched

  def gradients_only(self, batch: Any) -> None:
    """The step's own gradient work (zero1: the gradient halves; zero2: the micro-batch
    rounds and their reductions), with no program the step does not run; the loss is not
    read."""
    if self.zero.settings.stage == 1:
      jax.block_until_ready(self._gradient_buffers(batch))
    else:
      jax.block_until_ready(self._reduced(batch, votes=False)[0])

  def _handed_off(self, metrics: dict | None) -> dict:
    """``metrics`` where this process holds a core device, else those its classes hand it
    (``metrics_handoff``); every class of ``handoff`` this process holds runs its program."""
    for i in self.handoff:
      if self.local[i]:
        handed = hand_off(self.cache, self.programs[i].mesh, metrics)
        metrics = metrics or handed
    return metrics

  def _reduced(self, batch: Any, *, votes: bool = True
               ) -> tuple[dict | None, dict | None, list[dict | None]]:
    """The step's gradients reduced into the pieces (``ShardedOptimizer.reduce``): zero1,
    each class's gradient half then one reduction; zero2, one round per micro-batch (as
    many as the class with the most), each class running its next micro-batch (zeros once
    it has none left) and the round reduced into the running sum. Returns the pieces, the
    per-device sums (``reduce``'s; None in a process with no core device) and the last round's
    buffers' positions past ``t_min`` (``CrossClassSync.outer``: the core positions are
    freed before the update). ``votes``: phases voted on where steps commit."""
    phase = self._phase if votes else lambda _, run: run()
    if self.zero.settings.stage == 1:
      buffers = phase("grad", lambda: self._gradient_buffers(batch))
      pieces, sums = self._reduction(phase, "reduce", buffers, None, last=True)
      return pieces, sums, self.sync.outer(buffers)
    rounds, inputs = [], []
    for program, local, (start, _) in zip(self.programs, self.local, self.plan.class_rows()):
      c = program.replica_class
      rounds.append(micro_starts(c.batch_share, c.microbatches))
      inputs.append(class_batch(program, batch, start) if local else None)
    pieces = sums = buffers = None
    count = max(map(len, rounds))
    for i in range(count):
      def micro(i=i):
        out: list[dict | None] = []
        for program, local, rows, x in zip(self.programs, self.local, rounds, inputs):
          if not local:
            out.append(None)
          elif i < len(rows):
            out.append(program.step.micro_grad(program.params, x, np.int32(rows[i][0]),
                                               size=rows[i][1]))
          else:  # this class's rows are done: it adds nothing to the sums
            out.append(program.step.pack(program.step.zeros(program.params)))
        if i == 0 and self.before_sync is not None:
          jax.block_until_ready(out)
          self.before_sync()
        return out

      buffers = phase(f"grad{i}", micro)
      pieces, sums = self._reduction(phase, f"reduce{i}", buffers, pieces, last=i == count - 1)
    return pieces, sums, self.sync.outer(buffers)

  def _reduction(self, phase: Callable[[str, Callable[[], Any]], Any], name: str,
                 buffers: list[dict | None], total: dict | None, *, last: bool
                 ) -> tuple[dict | None, dict | None]:
    """One round's ``ShardedOptimizer.reduce`` as phase ``name``; where it is two programs
    (``reduce_in_two``: two groupings of the devices), each a phase of its own, the second
    ``name + "_copies"``, so that a loss inside the first leaves nobody waiting in the
    second."""
    return self.zero.reduce(buffers, total, last=last,
                            phase=lambda suffix, run: phase(name + suffix, run))

  def _phase(self, name: str, run: Callable[[], Any]) -> Any:
    """``run()``; where steps commit, its outputs once every live process voted that its
    own are ready (``job_step.voted``)."""
    return run() if self.commit is None else voted(self.commit, name, run)

  # -- the optimizer state in the class layout ------------------------------------------------

  def class_programs(self, dead: Collection[jax.Device] = frozenset(),
                     lost: Collection[jax.Device] = frozenset(),
                     survivors: Sequence[ClassProgram] | None = None) -> list[ClassProgram]:
    """The training state in the class layout, as a replicated run keeps it: copies of the
    class programs whose ``opt_state`` is the sharded state given back (abstract for a
    class of another process), for a checkpoint or a move to another plan. The step's own
    programs keep no optimizer state (``opt_state`` None: the pieces hold it).

    Args:
      dead: failed devices, whose pieces are taken from other copies.
      lost: the devices of lost processes (among ``dead`` or not).
      survivors: where ``lost`` holds devices of this plan, the class programs cut to
        the live processes' rows (``programs.live_rows``): the copies are of these, their
        state read back among them (``zero_survivors``), their parameters too where a
        process was lost after the step's update committed (``params_behind``).

    Raises:
      LookupError: a piece of the state cannot be read back
        (``ShardedOptimizer.class_opt_states``, ``zero_survivors.piece_givers``; also
        when ``lost`` holds devices of this plan and no ``survivors`` are given): the
        same in every process.
    """
    gone = sorted({d.process_index for p in self.programs for d in p.mesh.devices.flat
                   if d in set(lost)})
    if gone and survivors is None:  # the programs that read the pieces back span them
      raise LookupError(f"lost process(es) {gone} held devices of this plan, and the sharded "
                        f"optimizer state (train.optimizer_sharding={self.zero.settings.name}) "
                        "is read back by programs over every device of the plan")
    # The host's count; a process holding pieces reads the devices' (where the state keeps one).
    held = None if self.zero_state is None else step_count(self.zero_state["opt"])
    count = self.zero_count if held is None else int(np.asarray(held))
    if gone:
      rebuild = SurvivorRebuild(self.zero, self.programs, survivors, set(dead) | set(lost))
      # Lost after a committed update: the parameters from the master weights' pieces.
      params = (rebuild.params(self.zero_state) if self.params_behind
                else [None] * len(survivors))
      states = rebuild.opt_states(self.zero_state, self.opt_shapes, count)
      return [dataclasses.replace(p, opt_state=state, params=p.params if q is None else q)
              for p, state, q in zip(survivors, states, params)]
    if self.params_behind:  # only a lost process leaves them so (``__call__``)
      raise LookupError("the parameters are a step behind the optimizer's pieces and no lost "
                        "process's devices were given")
    states = self.zero.class_opt_states(self.zero_state, self.programs, self.opt_shapes,
                                        count, set(dead) | set(lost))
    return [dataclasses.replace(p, opt_state=shape if state is None else state)
            for p, state, shape in zip(self.programs, states, self.opt_shapes)]

  def take_pending_loss(self) -> ProcessLost | None:
    """The loss met after the last step's update committed (``__call__``), once: the
    step counts, and the loss is taken over before the next one."""
    lost, self.pending_loss = self.pending_loss, None
    return lost

  def lower_read_back(self) -> Callable[[], list]:
    """``() -> [(what, None, lowered)]``, the programs ``class_programs``
    runs that no step does (the zeroed templates, the gathering), for compiling ahead of a
    failure; bound to the shapes now (the arrays may be donated before it is called)."""
    zero = self.zero
    local = [(p.replica_class, p.step, jax.tree.map(_abstract, p.params))
             for p, here in zip(self.programs, self.local) if here]

    def lower():
      blocks = jax.eval_shape(local[0][1].pack, local[0][2])
      out = [(f"optimizer state read back ({class_label(c)})", None, lowered)
             for c, step, params in local for lowered in step.lower_read_back(params)]
      out.append(("optimizer state read back (gather)", None, zero.lower_gather([blocks])))
      live = zero.lower_gather_live([blocks])  # after a failure: pieces from live copies
      if live is not None:
        out.append(("optimizer state read back from live copies (gather)", None, live))
      return out

    return lower

  def lower_read_back_by_survivors(self, survivors: Sequence[ClassProgram],
                                   dead: Collection[jax.Device]) -> Callable[[], list]:
    """``() -> [(what, None, lowered)]``, the programs ``class_programs``
    runs when a lost process leaves ``survivors`` (cut, abstract: ``live_rows(...,
    shapes_only=True)``), for compiling ahead of the loss; bound now. It gives none
    where a piece would have no surviving holder (the loss takes the restart path)."""
    zero, programs, shapes = self.zero, list(self.programs), list(self.opt_shapes)
    state = None if self.zero_state is None else jax.tree.map(_abstract, self.zero_state)

    def lower():
      try:
        rebuild = SurvivorRebuild(zero, programs, survivors, dead)
      except LookupError:
        return []
      return [(what, None, lowered) for what, lowered in rebuild.lower(state, shapes)]

    return lower



def _read(metrics: dict[str, jax.Array]) -> dict[str, np.ndarray]:
  """Each metric (the same on every device that holds it) as a numpy scalar, read from one
  of this process's devices: no program over the others."""
  return {name: np.asarray(value.addressable_shards[0].data, np.float32).reshape(())
          for name, value in metrics.items()}


def _renewed(x: jax.Array) -> jax.Array:
  """``x`` where it is whole, else (donated to a program that did not commit) zeros of its
  shape and sharding on this process's devices: a layout to rebuild into."""
  if not x.is_deleted():
    return x
  shards = [jnp.zeros(x.sharding.shard_shape(x.shape), x.dtype, device=d)
            for d in mine(x.sharding.mesh)]
  return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)


def _abstract(x: Any) -> Any:
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
