"""``train.py`` with hooks for tests, chosen by environment variables (tests only).

  NTP_JAX_DIE_AFTER=P:S[,P:S...] NTP_JAX_WAIT_FOR_AHEAD=1 \\
    python tests/programs/train_with_hooks.py --config ... (train.py's flags)

- ``NTP_JAX_DIE_AFTER``: process ``P`` kills itself (SIGKILL) after step ``S``. A lost
  host at a known point of the run: the step is complete everywhere (its sync is
  shared), and a peer already waits at the next step's start, so the survivors meet
  the loss there (``processes.arrival``). A job whose survivors do not take a loss
  over (neither ``distributed.recoverable`` nor ``distributed.jit_checkpoint_s``)
  publishes no arrival: ``NTP_JAX_DIE_AT_ONCE=1`` kills without waiting for it (the
  survivors meet the loss in the next step's collective, and their heartbeat ends them).
- ``NTP_JAX_DIE_IN_SAVE=P:S``: process ``P`` kills itself (SIGKILL) inside the save of
  the checkpoint of step ``S``, as it starts reading the state off its devices: the
  survivors meet the loss in the save's collectives.
- ``NTP_JAX_DIE_IN_PHASE=P:S:PHASE``: process ``P`` kills itself (SIGKILL) as step ``S``
  enters ``PHASE`` of the sharded optimizer's step (``ShardedJobStep._phase``: ``grad``,
  ``reduce``, ``gather``, ``unpack``, ...): a loss placed after the update committed.
- ``NTP_JAX_WAIT_FOR_AHEAD=1``: before every step, wait for the compile ahead of the
  plans one event away to finish (``ntp.precompile``), as a long run's failures come
  long after it has.

Run by tests/system/test_multiprocess_recovery.py and bench/recovery_processes.py.
"""

import functools
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
from absl import app  # noqa: E402

import ntp_jax.training.trainer as trainer  # noqa: E402
import train  # noqa: E402
from ntp_jax.processes.arrival import arrival_key  # noqa: E402
from ntp_jax.training.hooks import Hook  # noqa: E402


class DieAfter(Hook):
  """Process ``process`` ends itself after ``step``, the ``epoch``-th loss of the job (the
  arrival keys of each plan after a loss carry the number of losses before it)."""

  def __init__(self, process: int, step: int, epoch: int, at_once: bool = False):
    self.process, self.step, self.epoch, self.at_once = process, step, epoch, at_once

  def on_step(self, info) -> None:
    if info.step == self.step and jax.process_index() == self.process:
      if self.at_once:
        os.kill(os.getpid(), signal.SIGKILL)
      # Once a peer waits at the next step's start: no collective of this step is still
      # running there (a kill inside one cannot be survived on gloo; docs/multihost.md).
      from jax._src import distributed as jax_distributed  # the coordination service's client
      peer = 1 if self.process == 0 else 0
      key = arrival_key(self.epoch, self.step + 1, peer, "start")
      jax_distributed.global_state.client.blocking_key_value_get(key, 60_000)
      # And every program this process dispatched has ended: with the sharded optimizer the
      # step's last programs (each class's unpacking, TP collectives) may outlast its loss.
      jax.block_until_ready(jax.live_arrays())
      os.kill(os.getpid(), signal.SIGKILL)


class WaitForAhead(Hook):
  def before_step(self, step, services):
    if not services.wait_for_compile_ahead(600):
      raise TimeoutError("the compile ahead did not finish in 600 s")
    return []


def die_in_save(process: int, step: int) -> None:
  """Process ``process`` ends itself as the save of step ``step`` reads the state."""
  import ntp_jax.training.loop as loop
  read, save = loop.logical_state, loop.TrainingRun._save

  def saving(run):
    if run.state.step == step and jax.process_index() == process:
      loop.logical_state = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    try:
      return save(run)
    finally:
      loop.logical_state = read

  loop.TrainingRun._save = saving


class DieInPhase(Hook):
  """Process ``process`` ends itself as step ``step`` enters ``phase``
  (``ShardedJobStep._phase``)."""

  def __init__(self, process: int, step: int, phase: str):
    import ntp_jax.parallel.sharded_step as sharded_step
    self.step, self.now = step, None
    enter = sharded_step.ShardedJobStep._phase

    def entering(job, name, run):
      if (self.now, name) == (step, phase) and jax.process_index() == process:
        os.kill(os.getpid(), signal.SIGKILL)
      return enter(job, name, run)

    sharded_step.ShardedJobStep._phase = entering

  def before_step(self, step, services):
    self.now = step
    return []


def hooks_from_environment() -> list[Hook]:
  hooks: list[Hook] = []
  if os.environ.get("NTP_JAX_WAIT_FOR_AHEAD") == "1":
    hooks.append(WaitForAhead())
  deaths = [tuple(map(int, item.split(":")))
            for item in os.environ.get("NTP_JAX_DIE_AFTER", "").split(",") if item]
  if os.environ.get("NTP_JAX_DIE_IN_PHASE"):
    process, step, phase = os.environ["NTP_JAX_DIE_IN_PHASE"].split(":")
    hooks.append(DieInPhase(int(process), int(step), phase))
  for epoch, (process, step) in enumerate(sorted(deaths, key=lambda d: d[1])):
    hooks.append(DieAfter(process, step, epoch,
                          at_once=os.environ.get("NTP_JAX_DIE_AT_ONCE") == "1"))
  return hooks


if __name__ == "__main__":
  if os.environ.get("NTP_JAX_DIE_IN_SAVE"):
    die_in_save(*map(int, os.environ["NTP_JAX_DIE_IN_SAVE"].split(":")))
  trainer.train = functools.partial(trainer.train, hooks=hooks_from_environment())
  app.run(train.main, flags_parser=train.parse_flags)
