"""One training step of the whole job over its class programs.

With one class the step is the class's ``steps.FusedStep`` (the DP
all-reduce inside the class program). With several: each class's gradient
half (``steps.SplitStep``) leaves its gradients in sync buffers;
``sync.CrossClassSync`` all-reduces the peer groups; each class's update
half applies them. Programs of different classes are dispatched back to
back and run concurrently on their own devices.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.parallel.accumulate import micro_starts
from ntp_jax.parallel.metrics_handoff import hand_off, handoff_classes
from ntp_jax.parallel.plan import Plan
from ntp_jax.parallel.programs import (
  ClassProgram,
  ProgramCache,
  cached_sync,
  class_batch,
  class_label,
  covering_classes,
)
from ntp_jax.parallel.sync import synced_loss
from ntp_jax.parallel.zero import ZeroSettings, cached_sharded_optimizer, runs_of, step_count
from ntp_jax.parallel.zero_survivors import SurvivorRebuild
from ntp_jax.processes.arrival import ProcessLost
from ntp_jax.sharding.topology import holds_mine, mine


class JobStep:
  """One training step of the whole job over its class programs.

  In a multi-process job each process calls the programs of the classes
  that hold its devices (``local``), reads only those classes' batch rows,
  and joins the cross-class all-reduce when it holds a core slot; the loss
  comes back from the all-reduce, so no process reads another's devices.

  Args:
    plan, programs: the plan and its class programs (``programs.build_class_programs``).
    cache: where the cross-class sync and the programs the step runs are kept (the run's
      ``ProgramCache``; default: a fresh one).
    split: the programs were built split (``build_class_programs(split=True)``): the
      gradient sync runs as its own program even with one class.
    before_sync: called after the gradients and before the sync (the step's first
      collective across processes when every TP group lies in one process): the
      arrival check of ``processes.arrival``. What it raises leaves the state as it was.
    zero: shard the optimizer state over the peer groups (``zero.ZeroSettings``; the
      programs built split): the class programs' ``opt_state`` moves into the step's
      sharded state and is None between steps (``optimizer_states`` gives it back).
    commit: steps that commit (``processes.commit``; the programs built split):
      ``commit(phase, error)`` is called once the collectives of a phase of the step
      (``"grad"``, ``"sync"``, ``"finish"``; with ``zero``, ``_sharded_step``'s) have ended
      here, with None or the error one of them raised; it returns when the phase ended in
      every live process and raises otherwise (``arrival.ProcessLost``), the state
      untouched. The update runs only once its inputs' phases passed (``SplitStep.apply_grads``,
      ``ShardedOptimizer.update``: no collective), so every survivor applies a step or none
      does.

  Raises:
    ValueError: this process holds no device of the plan.
  """

  def __init__(self, plan: Plan, programs: list[ClassProgram],
               cache: ProgramCache | None = None, *, split: bool = False,
               before_sync: Callable[[], None] | None = None,
               zero: ZeroSettings | None = None,
               commit: Callable[[str, BaseException | None], None] | None = None):
    if commit is not None and not split:
      raise ValueError("steps that commit need the split programs")
    self.plan = plan
    self.commit = commit
    self.pending_loss: ProcessLost | None = None  # lost after a committed update (zero)
    self.params_behind = False  # the parameters are a step behind the pieces (zero)
    self.programs = programs
    self.cache = cache or ProgramCache()
    self.before_sync = before_sync
    self.local = [holds_mine(p.mesh) for p in programs]
    if not any(self.local):
      raise ValueError(f"process {jax.process_index()} holds no live device of the plan "
                       f"(TP degrees {[r.degree for r in plan.replicas]})")
    self.sync = None
    self.sync_key = None
    if len(programs) > 1 or split or zero is not None:
      meshes, t_min = [p.mesh for p in programs], min(c.degree for c in plan.classes)
      self.sync_key, self.sync = cached_sync(self.cache, meshes, t_min)
    self.zero = self.zero_key = self.zero_state = None
    if zero is not None:
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
    """The ``ProgramCache`` keys of every program this step runs."""
    keys = [p.key for p in self.programs if p.key is not None]
    if self.zero_key is not None:  # the sharded update replaces the all-reduce
      return keys + [self.zero_key]
    return keys + ([self.sync_key] if self.sync_key is not None else [])

  def optimizer_states(self, dead: Collection[jax.Device] = frozenset(),
                       lost: Collection[jax.Device] = frozenset(),
                       survivors: Sequence[ClassProgram] | None = None) -> None:
    """With ``zero``: put the optimizer state back into the class programs in the class
    layout (``program.opt_state``), for a checkpoint or a move to another plan; a no-op
    otherwise. ``release_optimizer_states`` drops it again.

    Args:
      dead: failed devices, whose pieces are taken from other copies.
      lost: the devices of lost processes (among ``dead`` or not).
      survivors: where ``lost`` holds devices of this plan, the class programs cut to
        the live processes' rows (``programs.live_rows``): their ``opt_state`` is set
        instead, read back among them (``zero_survivors``), and their ``params`` too where
        a process was lost after the step's update committed (``params_behind``).

    Raises:
      LookupError: a piece of the state cannot be read back
        (``ShardedOptimizer.class_opt_states``, ``zero_survivors.piece_givers``; also
        when ``lost`` holds devices of this plan and no ``survivors`` are given): the
        same in every process.
    """
    if self.zero is None or self.programs[self.local.index(True)].opt_state is not None:
      return
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
      if self.params_behind:  # lost after a committed update: from the master weights
        for program, params in zip(survivors, rebuild.params(self.zero_state)):
          program.params = program.params if params is None else params
      for program, state in zip(survivors, rebuild.opt_states(self.zero_state,
                                                              self.opt_shapes, count)):
        program.opt_state = state
      return
    if self.params_behind:  # only a lost process leaves them so (``_sharded_step``)
      raise LookupError("the parameters are a step behind the optimizer's pieces and no lost "
                        "process's devices were given")
    states = self.zero.class_opt_states(self.zero_state, self.programs, self.opt_shapes,
                                        count, set(dead) | set(lost))
    for program, state, shape in zip(self.programs, states, self.opt_shapes):
      program.opt_state = shape if state is None else state

  def take_pending_loss(self) -> ProcessLost | None:
    """The loss met after the last step's update committed (``_sharded_step``), once: the
    step counts, and the loss is taken over before the next one."""
    lost, self.pending_loss = self.pending_loss, None
    return lost

  def lower_read_back_by_survivors(self, survivors: Sequence[ClassProgram],
                                   dead: Collection[jax.Device]) -> Callable[[], list]:
    """With ``zero``: ``() -> [(what, None, lowered)]``, the programs ``optimizer_states``
    runs when a lost process leaves ``survivors`` (cut, abstract: ``live_rows(...,
    shapes_only=True)``), for compiling ahead of the loss; bound now. It gives none
    where a piece would have no surviving holder (the loss takes the restart path)."""
    if self.zero is None:
      return list
    zero, programs, shapes = self.zero, list(self.programs), list(self.opt_shapes)
    state = None if self.zero_state is None else jax.tree.map(_abstract, self.zero_state)

    def lower():
      try:
        rebuild = SurvivorRebuild(zero, programs, survivors, dead)
      except LookupError:
        return []
      return [(what, None, lowered) for what, lowered in rebuild.lower(state, shapes)]

    return lower

  def lower_read_back(self) -> Callable[[], list]:
    """With ``zero``: ``() -> [(what, None, lowered)]``, the programs ``optimizer_states``
    runs that no step does (the zeroed templates, the gathering), for compiling ahead of a
    failure; bound to the shapes now (the arrays may be donated before it is called)."""
    if self.zero is None:
      return list
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

  def release_optimizer_states(self) -> None:
    """With ``zero``: drop the class layout's optimizer state (the sharded state holds it)."""
    if self.zero is not None:
      for program in self.programs:
        program.opt_state = None

  @property
  def first_local(self) -> ClassProgram:
    return self.programs[self.local.index(True)]

  def gradients_only(self, batch: Any) -> float | None:
    """Loss and gradients of ``batch`` (synced across classes), not applied.

    The work that a failure inside a step throws away; the state is unchanged. With a
    sharded optimizer it is the step's own gradient work (zero1: the gradient halves;
    zero2: the micro-batch rounds and their reductions), with no program the step does not
    run, and the loss is not read (None).
    """
    if self.zero is not None:
      if self.zero.settings.stage == 1:
        jax.block_until_ready(self._gradient_buffers(batch))
      else:
        jax.block_until_ready(self._reduced(batch, voted=False)[0])
      return None
    if self.sync is None:
      program = self.programs[0]
      loss, grads = program.step.gradients(program.params, class_batch(program, batch, 0))
      jax.block_until_ready(grads)
      return float(loss)
    synced = self._synced_buffers(batch)
    jax.block_until_ready(synced)
    i = self.local.index(True)
    mesh = self.programs[i].mesh
    read_loss = self.cache.program(("read loss", mesh), lambda: jax.jit(
        synced_loss, out_shardings=NamedSharding(mesh, P())))
    return float(read_loss(synced[i]))

  def eval_loss(self, sequences: np.ndarray) -> float:
    """Mean next-token loss of ``sequences`` (int32 ``[n, seq_len + 1]``), no update.

    Every replica holds the same parameters, so one class evaluates (one per
    process group in a multi-process job, ``covering_classes``): each of its
    replicas computes every row, in chunks of the class's training
    micro-batch (so activations fit as in a step; a shorter last chunk
    compiles once more).
    """
    value = None
    for i in covering_classes(self.programs):
      if not self.local[i]:
        continue
      program = self.programs[i]
      # A training micro-batch: at most the healthy one's rows.
      rows = -(-program.replica_class.batch_share // program.replica_class.microbatches)
      replicated = NamedSharding(program.mesh, P())
      total = 0.0
      for start in range(0, len(sequences), rows):
        chunk = np.asarray(sequences[start:start + rows], np.int32)
        total += float(program.step.eval_loss(program.params, jax.make_array_from_callback(
            chunk.shape, replicated, lambda index, c=chunk: c[index])))
      value = total / (len(sequences) * (sequences.shape[1] - 1)) if value is None else value
    return value

  def _sharded_step(self, batch: Any) -> dict[str, jax.Array]:
    """The step with the sharded optimizer (``zero``): the gradients reduced into the
    pieces, the update of the pieces, and each class's parameters unpacked from the gathered
    buffers; with ``commit``, a vote after each phase of collectives (``_phase``).

    The update runs once every live process voted that the reduction ended well, so every
    survivor updates its pieces or none does. From then on the pieces are the state: a
    process lost while the parameters are gathered or unpacked leaves the step applied, the
    loss waiting in ``pending_loss`` and the parameters to be rebuilt from the master
    weights' pieces (``params_behind``; ``optimizer_states``)."""
    self.release_optimizer_states()  # the sharded state moves on: a class copy would be stale
    pieces, metrics, templates = self._reduced(batch)
    if self.handoff:  # the processes with no core device take the metrics from their class
      metrics = self._phase("metrics", lambda: self._handed_off(metrics))
    self.zero_state = self.zero.update(pieces, self.zero_state)
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
      return metrics
    for program, local, new in zip(self.programs, self.local, params):
      if local:
        program.params = new
    self.params_behind = False
    return metrics

  def _handed_off(self, metrics: dict | None) -> dict:
    """``metrics`` where this process holds a core device, else those its classes hand it
    (``metrics_handoff``); every class of ``handoff`` this process holds runs its program."""
    for i in self.handoff:
      if self.local[i]:
        handed = hand_off(self.cache, self.programs[i].mesh, metrics)
        metrics = metrics or handed
    return metrics

  def _reduced(self, batch: Any, *, voted: bool = True
               ) -> tuple[dict | None, dict | None, list[dict | None]]:
    """The step's gradients reduced into the pieces (``ShardedOptimizer.reduce``): zero1,
    each class's gradient half then one reduction; zero2, one round per micro-batch (as
    many as the class with the most), each class running its next micro-batch (zeros once
    it has none left) and the round reduced into the running sum. Returns the clipped
    pieces, the metrics (None in a process with no core device) and the last round's
    buffers' positions past ``t_min`` (``CrossClassSync.outer``: the core positions are
    freed before the update). ``voted``: phases voted on where steps commit."""
    phase = self._phase if voted else lambda _, run: run()
    if self.zero.settings.stage == 1:
      buffers = phase("grad", lambda: self._gradient_buffers(batch))
      pieces, metrics = phase("reduce", lambda: self.zero.reduce(buffers))
      return pieces, metrics, self.sync.outer(buffers)
    rounds, inputs = [], []
    for program, local, (start, _) in zip(self.programs, self.local, self.plan.class_rows()):
      c = program.replica_class
      rounds.append(micro_starts(c.batch_share, c.microbatches))
      inputs.append(class_batch(program, batch, start) if local else None)
    pieces = metrics = buffers = None
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
      pieces, metrics = phase(f"reduce{i}", lambda b=buffers, t=pieces, last=i == count - 1:
                              self.zero.reduce(b, t, last=last))
    return pieces, metrics, self.sync.outer(buffers)

  def _phase(self, name: str, run: Callable[[], Any]) -> Any:
    """``run()``; where steps commit (``commit``), its outputs once they are ready here and
    every live process voted that its own are (``commit`` raises otherwise)."""
    if self.commit is None:
      return run()
    return self._voted(name, run)

  def _gradient_buffers(self, batch: Any) -> list[dict | None]:
    """Each local class's gradient buffers (None elsewhere), then ``before_sync``."""
    buffers: list[dict | None] = []
    for program, local, (start, _) in zip(self.programs, self.local, self.plan.class_rows()):
      buffers.append(program.step.gradients(program.params, class_batch(program, batch, start))
                     if local else None)
    if self.before_sync is not None:
      jax.block_until_ready(buffers)  # the gradients are this process's own work: done first
      self.before_sync()
    return buffers

  def _synced_buffers(self, batch: Any) -> list[dict | None]:
    """Several classes: each local class's synced gradient buffers (None elsewhere)."""
    return self.sync(self._gradient_buffers(batch))

  def _committed_step(self, batch: Any) -> dict[str, jax.Array]:
    """A step that commits: its collectives in three phases, each ended everywhere and voted
    on (``commit``) before the next starts, then the update alone. Nothing before the last
    vote consumes the state.

    The phases: each class's gradients (collectives within each replica), the sync (across
    replicas), ``SplitStep.finish`` (within each replica again). The votes between them
    keep every collective entered by all of its live processes or by none: one left
    half-entered (a survivor waits in it for a peer whose earlier collective failed) breaks
    its communicator, and XLA's CPU backend keeps a communicator per set of devices for the
    life of the process, so the next plan would meet it again.
    """
    buffers = self._voted("grad", lambda: self._gradient_buffers(batch))
    synced = self._voted("sync", lambda: self.sync(buffers))
    finished = self._voted("finish", lambda: [
        program.step.finish(buffers, program.params) if local else None
        for program, local, buffers in zip(self.programs, self.local, synced)])
    metrics = None
    for program, local, out in zip(self.programs, self.local, finished):
      if local:
        grads, class_metrics = out
        program.params, program.opt_state = program.step.apply_grads(
            program.params, program.opt_state, grads, class_metrics["grad_norm"])
        # Every replica read the same values: one of this process's rows gives them.
        metrics = metrics or {name: np.asarray(value.addressable_shards[0].data)[0]
                              for name, value in class_metrics.items()}
    return metrics

  def _voted(self, phase: str, run: Callable[[], Any]) -> Any:
    """``run()``'s outputs once they are ready here and every live process voted that its
    own are (``commit``, which raises otherwise)."""
    try:
      outputs = run()
      jax.block_until_ready(outputs)
    except jax.errors.JaxRuntimeError as err:  # a collective with a lost peer, or past its bound
      self.commit(phase, err)  # raises: the step is thrown away everywhere
      raise
    self.commit(phase, None)
    return outputs

  def __call__(self, batch: Any) -> dict[str, jax.Array]:
    """``batch``: int32 ``[plan.global_batch, seq + 1]`` rows in class order (or a lazy
    ``loop.DatasetRows``); returns the job's ``loss`` and ``grad_norm``, replicated over a
    class mesh this process holds (steps that commit: f32 numpy scalars, read here)."""
    if self.zero is not None:
      return self._sharded_step(batch)
    if self.commit is not None:
      return self._committed_step(batch)
    if self.sync is None:  # one class: the fused step reads the batch itself
      inputs = [class_batch(self.programs[0], batch, 0)]
    else:
      inputs = self._synced_buffers(batch)
    metrics = None
    for program, local, x in zip(self.programs, self.local, inputs):
      if local:
        program.params, program.opt_state, class_metrics = program.step.apply(
            program.params, program.opt_state, x)
        metrics = metrics or class_metrics
    return metrics


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
