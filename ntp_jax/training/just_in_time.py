"""A just-in-time checkpoint: the survivors of a lost process write the last completed step.

A process is lost (its heartbeat stopped) before a step's gradient sync
(``processes.arrival``): the step's update has not run, so every surviving
replica still holds the state after the last completed step. One survivor
that holds a whole replica copies it off its devices (no collective) and writes it
as a normal checkpoint (logical form,
the run's ``checkpoint.dir``, the step and data position in its metadata),
through an orbax manager over the survivors only; the others wait for it.
Then every survivor stops (``process_guard.ProcessStop``) with one line
naming the lost process, the step written and the seconds it took; the
restart with the processes left resumes there and redoes at most the step
that was in flight. Source: Gupta et al., "Just-In-Time Checkpointing",
EuroSys 2024 (the state of the healthy replicas at the failure, so no step is
redone but the one in flight).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import nnx

from ntp_jax.processes.arrival import ProcessLost
from ntp_jax.processes.heartbeat import end_process
from ntp_jax.sharding.blocks import from_blocks
from ntp_jax.sharding.topology import processes_of
from ntp_jax.state.checkpoint import Checkpoints, restart_hint
from ntp_jax.state.placement import Path, leaves_of

DONE_KEY = "ntp_jax/just_in_time"


def whole_replica(programs: list, survivors: set[int]) -> tuple[int, int, int] | None:
  """``(process, class index, row)`` of the first replica whose devices all lie in one
  surviving process (lowest process first), or None when no survivor holds a whole one.
  The same answer in every process: it depends on the plan only."""
  found = []
  for c, program in enumerate(programs):
    for r, row in enumerate(program.mesh.devices):
      processes = processes_of(row)
      if len(processes) == 1 and processes <= survivors:
        found.append((next(iter(processes)), c, r))
  return min(found) if found else None


@dataclasses.dataclass(frozen=True)
class JustInTimeState:
  """What a just-in-time checkpoint writes: the state after ``step`` steps.

  Attributes:
    programs: the class programs (``parallel.programs.ClassProgram``), their update not run.
    plan: their plan. step: steps completed. cursor: the data cursor after them.
    config: the run's config as JSON (``RunConfig.to_json_dict``), for the metadata.
  """

  programs: list
  plan: Any
  step: int
  cursor: int
  config: dict


def write_just_in_time(job, lost: ProcessLost, survivors: set[int], state: JustInTimeState,
                       checkpoints: Checkpoints | None, log: Callable[..., None],
                       event: Callable[..., None]) -> str:
  """Write ``state`` (the last completed step) from the ``survivors`` and return the line
  that ends the process (naming the lost process and what was written, or why nothing was).

  ``job`` is this process's ``distributed.Job``. The whole takes at most
  ``distributed.jit_checkpoint_s`` seconds: past that, a watching thread ends the process
  (``heartbeat.end_process``, exit status ``heartbeat.LOST_EXIT_CODE``), since the main
  thread is then held by the lost peer.
  """
  start = time.perf_counter()
  bound = job.jit_checkpoint_s
  fallback = restart_hint(checkpoints.directory if checkpoints is not None else None)
  if bound <= 0:
    return (f"{lost.message}; distributed.jit_checkpoint_s=0: no just-in-time checkpoint; "
            f"{fallback}")
  if checkpoints is None:
    return (f"{lost.message}; checkpoint.every=0: no just-in-time checkpoint; the run "
            "starts again from its beginning")
  if any(p.opt_state is None for p in state.programs):  # train.optimizer_sharding=zero*
    return (f"{lost.message}; the optimizer state is sharded over the replicas, so no "
            f"survivor holds a whole replica's: no just-in-time checkpoint; {fallback}")
  holder = whole_replica(state.programs, survivors)
  if holder is None:
    return (f"{lost.message}; the processes left hold no whole replica, so no just-in-time "
            f"checkpoint; {fallback}")
  writer, c, r = holder
  log(f"step {state.step}: {lost.message}; writing a just-in-time checkpoint of step "
      f"{state.step} (process {writer}, within distributed.jit_checkpoint_s={bound:g})")
  timer = threading.Timer(bound, lambda: end_process(
      f"{lost.message}; the just-in-time checkpoint of step {state.step} did not finish "
      f"within distributed.jit_checkpoint_s={bound:g}; {fallback}"))
  timer.daemon = True
  timer.start()
  try:
    if job.process_id == writer:
      try:
        _write(state, lost, checkpoints, writer, c, r)
      except Exception as err:  # e.g. a buffer the lost peer's last collective left in error
        cause = " ".join(str(err).split())[:200]
        return (f"{lost.message}; the just-in-time checkpoint of step {state.step} failed "
                f"({type(err).__name__}: {cause}); {fallback}")
      job.client.key_value_set(DONE_KEY, str(state.step), allow_overwrite=True)
    else:  # the writer says when the step is on disk
      job.client.blocking_key_value_get(DONE_KEY, int(bound * 1000))
  finally:
    timer.cancel()
  seconds = time.perf_counter() - start
  event("just_in_time", step=state.step, processes=sorted(lost.processes),
        seconds=round(seconds, 3), data_cursor=state.cursor)
  return (f"{lost.message}; process {job.process_id} wrote a just-in-time checkpoint of "
          f"step {state.step} to {checkpoints.step_dir(state.step)} in {seconds:.1f} s "
          f"(within distributed.jit_checkpoint_s={bound:g}); restart the job with the "
          "processes left: it resumes there")


def _write(state: JustInTimeState, lost: ProcessLost, checkpoints: Checkpoints, writer: int,
           c: int, r: int) -> None:
  """Replica ``r`` of class ``c`` (all on process ``writer``) as checkpoint ``state.step``."""
  logical = host_logical(state.programs[c], r)
  meta = {"data_cursor": state.cursor, "plan": state.plan.summary(),
          "config": state.config, "just_in_time": True,
          "lost_processes": sorted(lost.processes)}
  only_writer = Checkpoints(checkpoints.directory, keep=checkpoints.keep, asynchronous=False,
                            processes={writer})
  only_writer.save(state.step, logical, meta)
  only_writer.wait()


def host_logical(program, replica: int) -> dict[Path, np.ndarray]:
  """One replica's state as logical host arrays, from its devices' own buffers.

  No program runs, so nothing can wait on the lost process: each device's block is
  copied to the host and the blocks are joined there (``blocks.from_blocks``).
  """
  row = list(program.mesh.devices[replica])
  leaves, _, nodes = leaves_of({"params": program.params, "opt_state": program.opt_state})
  out = {}
  for leaf, node in zip(leaves, nodes):
    value = node.get_value() if isinstance(node, nnx.Variable) else node
    by_device = {s.device: s.data for s in value.addressable_shards}
    if leaf.layout is not None:  # [1, 1, *block] per device
      blocks = np.stack([np.asarray(by_device[d])[0, 0] for d in row])
      out[leaf.path] = np.asarray(from_blocks(blocks, leaf.layout, leaf.axis))
    elif leaf.stacked:  # [1, *shape] per device: the replica's own copy
      out[leaf.path] = np.asarray(by_device[row[0]])[0]
    else:
      out[leaf.path] = np.asarray(by_device[row[0]])
  return out
