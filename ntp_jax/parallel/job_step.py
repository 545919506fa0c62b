"""One training step of the whole job over its class programs, one class per way of
stepping, chosen once per plan (``make_job_step``).

- ``FusedJobStep``: one class, the class's ``steps.FusedStep`` (the DP all-reduce inside
  the class program).
- ``SyncedJobStep``: each class's gradient half (``steps.SplitStep``) leaves its gradients
  in sync buffers; ``sync.CrossClassSync`` all-reduces the peer groups; each class's update
  half applies them. Programs of different classes are dispatched back to back and run
  concurrently on their own devices.
- ``CommittedJobStep``: the same halves with a vote after each phase of collectives
  (``processes.commit``), the update only after the last.
- ``sharded_step.ShardedJobStep``: the optimizer state sharded over the peer groups
  (``zero``), voted on or not.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ntp_jax.parallel.plan import Plan
from ntp_jax.parallel.programs import (
  ClassProgram,
  ProgramCache,
  cached_sync,
  class_batch,
  covering_classes,
)
from ntp_jax.parallel.sync import synced_loss
from ntp_jax.processes.arrival import ProcessLost
from ntp_jax.sharding.topology import holds_mine

Commit = Callable[[str, BaseException | None], None]


class JobStep:
  """What every way of stepping the job shares: the plan, its class programs and which of
  them hold a device of this process (``local``), evaluation, and the optimizer state in
  the class layout (kept there: the hooks of a sharded state are no-ops here).

  In a multi-process job each process calls the programs of the classes that hold its
  devices, reads only those classes' batch rows, and joins the collectives across classes
  when it holds a core slot; the loss comes back from them, so no process reads another's
  devices.

  Args:
    plan, programs: the plan and its class programs (``programs.build_class_programs``).
    cache: where the programs the step runs are kept (the run's ``ProgramCache``;
      default: a fresh one).

  Raises:
    ValueError: this process holds no device of the plan.
  """

  zero = zero_key = sync = sync_key = commit = None

  def __init__(self, plan: Plan, programs: list[ClassProgram],
               cache: ProgramCache | None = None):
    self.plan, self.programs = plan, programs
    self.cache = cache or ProgramCache()
    self.local = [holds_mine(p.mesh) for p in programs]
    if not any(self.local):
      raise ValueError(f"process {jax.process_index()} holds no live device of the plan "
                       f"(TP degrees {[r.degree for r in plan.replicas]})")

  @property
  def keys(self) -> list:
    """The ``ProgramCache`` keys of every program this step runs."""
    keys = [p.key for p in self.programs if p.key is not None]
    return keys + ([self.sync_key] if self.sync_key is not None else [])

  @property
  def first_local(self) -> ClassProgram:
    return self.programs[self.local.index(True)]

  def __call__(self, batch: Any) -> dict[str, Any]:
    """``batch``: int32 ``[plan.global_batch, seq + 1]`` rows in class order (or a lazy
    ``loop.DatasetRows``); returns the job's ``loss`` and ``grad_norm`` (f32 scalars:
    arrays replicated over a class mesh this process holds, or numpy values)."""
    raise NotImplementedError

  def gradients_only(self, batch: Any) -> float | None:
    """Loss and gradients of ``batch`` (synced across classes), not applied: the work that
    a failure inside a step throws away; the state is unchanged. None where the loss is
    not read."""
    raise NotImplementedError

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

  # -- the state a sharded optimizer holds apart (``sharded_step``); here the classes hold it --

  def class_programs(self, dead: Collection[jax.Device] = frozenset(),
                     lost: Collection[jax.Device] = frozenset(),
                     survivors: Sequence[ClassProgram] | None = None) -> list[ClassProgram]:
    """The training state in the class layout (for a checkpoint or a move to another plan):
    here the class programs hold it, so they are returned as they are (``survivors``, the
    programs cut to the live processes' rows, where given). ``dead`` and ``lost`` are the
    failed devices and the lost processes' (``sharded_step.ShardedJobStep`` reads its
    pieces around them)."""
    return list(self.programs if survivors is None else survivors)

  def take_pending_loss(self) -> ProcessLost | None:
    """A loss met after the last step's update committed: none here (the update is the
    last thing a step does)."""
    return None

  def lower_read_back(self) -> Callable[[], list]:
    """``() -> [(what, None, lowered)]``, the programs that give the optimizer state back
    at a failure: none here."""
    return list

  def lower_read_back_by_survivors(self, survivors: Sequence[ClassProgram],
                                   dead: Collection[jax.Device]) -> Callable[[], list]:
    """As ``lower_read_back``, after a lost process: none here."""
    return list


class FusedJobStep(JobStep):
  """One class: its fused step, which reads the batch itself."""

  def __call__(self, batch: Any) -> dict[str, jax.Array]:
    program = self.programs[0]
    program.params, program.opt_state, metrics = program.step.apply(
        program.params, program.opt_state, class_batch(program, batch, 0))
    return metrics

  def gradients_only(self, batch: Any) -> float:
    program = self.programs[0]
    loss, grads = program.step.gradients(program.params, class_batch(program, batch, 0))
    jax.block_until_ready(grads)
    return float(loss)


class SyncedJobStep(JobStep):
  """Each class's gradient half, the sync across classes, each class's update half.

  Args:
    plan, programs, cache: as for ``JobStep`` (the programs built split,
      ``build_class_programs(split=True)``, or several classes).
    before_sync: called after the gradients and before the sync (the step's first
      collective across processes when every TP group lies in one process): the
      arrival check of ``processes.arrival``. What it raises leaves the state as it was.
  """

  def __init__(self, plan: Plan, programs: list[ClassProgram],
               cache: ProgramCache | None = None, *,
               before_sync: Callable[[], None] | None = None):
    super().__init__(plan, programs, cache)
    self.before_sync = before_sync
    meshes, t_min = [p.mesh for p in programs], min(c.degree for c in plan.classes)
    self.sync_key, self.sync = cached_sync(self.cache, meshes, t_min)

  def __call__(self, batch: Any) -> dict[str, jax.Array]:
    metrics = None
    for program, local, x in zip(self.programs, self.local, self._synced_buffers(batch)):
      if local:
        program.params, program.opt_state, class_metrics = program.step.apply(
            program.params, program.opt_state, x)
        metrics = metrics or class_metrics
    return metrics

  def gradients_only(self, batch: Any) -> float:
    synced = self._synced_buffers(batch)
    jax.block_until_ready(synced)
    i = self.local.index(True)
    mesh = self.programs[i].mesh
    read_loss = self.cache.program(("read loss", mesh), lambda: jax.jit(
        synced_loss, out_shardings=NamedSharding(mesh, P())))
    return float(read_loss(synced[i]))

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



class CommittedJobStep(SyncedJobStep):
  """Steps that commit (``processes.commit``; the programs built split): each phase of the
  step's collectives ended everywhere and voted on before the next starts, then the update
  alone.

  Args:
    plan, programs, cache: as for ``SyncedJobStep``.
    commit: ``commit(phase, error)`` is called once the collectives of a phase of the step
      (``"grad"``, ``"sync"``, ``"finish"``) have ended here, with None or the error one of
      them raised; it returns when the phase ended in every live process and raises
      otherwise (``arrival.ProcessLost``), the state untouched. Only after the last phase
      does the update run (``SplitStep.apply_grads``: no collective), so every survivor
      applies a step or none does.
  """

  def __init__(self, plan: Plan, programs: list[ClassProgram],
               cache: ProgramCache | None = None, *, commit: Commit):
    super().__init__(plan, programs, cache)
    self.commit = commit

  def __call__(self, batch: Any) -> dict[str, np.ndarray]:
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
    buffers = voted(self.commit, "grad", lambda: self._gradient_buffers(batch))
    synced = voted(self.commit, "sync", lambda: self.sync(buffers))
    finished = voted(self.commit, "finish", lambda: [
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



# What a collective with a lost peer (or past its bound) raises: jaxlib reports it as a
# ValueError where the program ran inside its dispatch (seen on CPU: a small program's
# gloo all-reduce, "Connection closed by peer"). Any other error is raised again once the
# vote found nobody lost (``process_guard.ProcessGuard.commit``).
COLLECTIVE_ERRORS = (jax.errors.JaxRuntimeError, ValueError)


def voted(commit: Commit, phase: str, run: Callable[[], Any]) -> Any:
  """``run()``'s outputs once they are ready here and every live process voted that its own
  are (``commit``, which raises otherwise: the step is thrown away everywhere)."""
  try:
    outputs = run()
    jax.block_until_ready(outputs)
  except COLLECTIVE_ERRORS as err:
    commit(phase, err)  # raises
    raise
  commit(phase, None)
  return outputs
