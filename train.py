"""Train a GPT with nonuniform tensor parallelism.

  python train.py --config configs/gpt_tiny.py
  python train.py --config configs/gpt_tiny.py --config.mesh.tp=8 --config.ntp.failed=3

Kept short on purpose: it parses the config, makes sure enough devices exist
(on a machine without an accelerator it simulates ``mesh.dp * mesh.tp`` CPU
devices, set before JAX starts, unless ``XLA_FLAGS`` already sets a count),
joins a multi-process job when the config or the environment asks for one
(``ntp_jax.processes.distributed``), and calls ``ntp_jax.training.trainer.train``.
"""

import os
import sys
import traceback

from absl import app, logging
from absl.flags import FLAGS
from ml_collections import config_flags

from ntp_jax.processes.heartbeat import LOST_EXIT_CODE  # no JAX here: XLA_FLAGS come first

CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).")


def simulate_cpu_devices(count: int) -> None:
  """Ask XLA for ``count`` host devices unless the user already chose a count.

  Only the CPU platform reads this flag, so it is harmless on GPU machines.
  Must run before JAX is imported.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def cpu_devices_per_process(run_config, processes: int) -> int:
  """The CPU devices this process simulates; with several processes on CPU, the job's layout
  checked first (``processes.job_layout``: a ``ConfigError`` naming the field)."""
  from ntp_jax.processes.distributed import expects_gpu
  from ntp_jax.processes.job_layout import DEVICE_COUNT_FLAG, check_job_layout, forced_device_count
  mesh = run_config.mesh
  if processes == 1 or expects_gpu():  # on GPU the count is the machine's, known later
    return max(1, mesh.devices // processes)
  given = forced_device_count(os.environ.get("XLA_FLAGS", ""))
  return check_job_layout(mesh.tp, mesh.dp, run_config.distributed.processes_per_domain,
                          processes, given, f"XLA_FLAGS {DEVICE_COUNT_FLAG}")


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing; every command-line mistake is one line naming the file or the
  field (``ntp_jax.training.cli``), exit status 2."""
  from ntp_jax.errors import ConfigError
  from ntp_jax.training.cli import parse_command_line
  try:
    return parse_command_line(argv)
  except ConfigError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


def main(argv):
  del argv  # parse_flags refuses left-over arguments
  logging.set_verbosity(logging.WARNING)  # JAX's platform probing logs at INFO
  config = CONFIG.value
  # These import JAX; its backend starts later, reading XLA_FLAGS.
  from ntp_jax.errors import ConfigError
  from ntp_jax.processes import distributed
  from ntp_jax.training.config import RunConfig
  try:
    # Every field checked once, here; a field the file made up is named with the file.
    run_config = RunConfig.from_config(config, config_flags.get_config_filename(FLAGS["config"]))
    processes = distributed.processes_in_config(run_config.distributed)
    # Several processes (ntp_jax.launch, SLURM, ...) share the devices of the job.
    simulate_cpu_devices(cpu_devices_per_process(run_config, processes))
  except ConfigError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
  if processes > 1:  # a stop during start-up: every process stops at one step, not this one
    from ntp_jax.resilience.signals import hold_stop_signals
    hold_stop_signals()

  from ntp_jax.data import DataError
  from ntp_jax.state.checkpoint import CheckpointError
  from ntp_jax.training.process_guard import ProcessStop
  from ntp_jax.training.trainer import train
  job = None
  try:
    job = distributed.join(run_config.distributed)
    train(run_config)
  except ProcessStop as stop:  # a lost peer ends this process (a just-in-time checkpoint first)
    print(f"error: {stop.message}", file=sys.stderr)
    _exit(job, stop.status)
  except (ConfigError, DataError) as err:
    if isinstance(err, CheckpointError):
      # A collective save that failed is often a lost peer: let the heartbeat name it first.
      _stop_if_a_peer_was_lost(job, err, "saving a checkpoint", run_config)
    print(f"error: {err}", file=sys.stderr)
    _exit(job, 2)
  except Exception as err:
    if job is None or not job.multi_process:
      raise
    # An error inside a collective is often a lost peer: let the heartbeat name it.
    _stop_if_a_peer_was_lost(job, err, "in a step", run_config)
    traceback.print_exc()
    _exit(job, 1)
  if job is not None:
    job.finish()


def _stop_if_a_peer_was_lost(job, err: Exception, where: str, run_config) -> None:
  """After ``err`` in a multi-process job: if the heartbeat finds a lost peer, one line that
  names it (and ``err`` as its effect) and what a restart resumes from, then exit with
  ``LOST_EXIT_CODE``; else return."""
  if job is None or job.heartbeat is None:
    return
  from ntp_jax.state.checkpoint import restart_hint
  lost = job.heartbeat.wait_for_verdict()
  if lost is not None:
    cause = " ".join(str(err).split())[:160]
    checkpoints = run_config.checkpoint
    hint = restart_hint(checkpoints.dir if checkpoints.enabled else None)
    print(f"error: {lost}; process {job.process_id} stops ({type(err).__name__} {where}: "
          f"{cause}); {hint}", file=sys.stderr)
    _exit(job, LOST_EXIT_CODE)


def _exit(job, status: int) -> None:
  """Exit; a failed process of a multi-process job skips JAX's shutdown barrier, which
  would wait for the others (they stop through their heartbeat or the launcher)."""
  if job is not None and job.multi_process:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  sys.exit(status)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
