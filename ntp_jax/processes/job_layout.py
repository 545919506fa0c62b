"""Whether a job's processes can share its mesh, checked from counts before any process starts.

``python -m ntp_jax.launch`` checks this once, before starting a process, and ``train.py``
in every process before JAX starts (a job started by ``srun``): more processes than the
mesh has devices, devices that do not split evenly over the processes, a process left with
no device of the mesh, a scale-up domain larger than the job or cut by a TP group
(``distributed.check_domains``, the rule the run applies to its real devices).
"""

from __future__ import annotations

import dataclasses
import re

from ntp_jax.errors import ConfigError
from ntp_jax.processes.distributed import check_domains

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True)
class _StandIn:
  """A device known only by its process (what ``check_domains`` reads)."""

  process_index: int


def devices_per_process(mesh_devices: int, processes: int, given: int | None = None,
                        given_field: str = "--devices-per-process") -> int:
  """The CPU devices each process simulates: ``given``, else the mesh's shared evenly.

  Args:
    mesh_devices: ``mesh.dp * mesh.tp``.
    processes: the job's processes.
    given: a count chosen by the user (``given_field`` names where), or None.

  Raises:
    ConfigError: more processes than devices, devices that do not split evenly, too few
      devices given, or a process that would hold none of the mesh's devices.
  """
  if given is None:
    if processes > mesh_devices:
      raise ConfigError(f"mesh.dp * mesh.tp: {mesh_devices} devices for {processes} processes; "
                        f"each process needs one at least (use at most {mesh_devices} "
                        "processes, or a larger mesh)")
    if mesh_devices % processes:
      raise ConfigError(f"mesh.dp * mesh.tp: {mesh_devices} devices do not split evenly over "
                        f"{processes} processes (use a process count that divides "
                        f"{mesh_devices})")
    return mesh_devices // processes
  if given * processes < mesh_devices:
    raise ConfigError(f"{given_field}: {processes} processes x {given} devices = "
                      f"{given * processes}, fewer than mesh.dp * mesh.tp = {mesh_devices}")
  if (processes - 1) * given >= mesh_devices:
    raise ConfigError(f"{given_field}: with {given} devices per process, process "
                      f"{processes - 1} would hold none of the {mesh_devices} devices of "
                      "mesh.dp * mesh.tp")
  return given


def check_job_layout(tp: int, dp: int, processes_per_domain: int, processes: int,
                     given: int | None = None, given_field: str = "--devices-per-process") -> int:
  """Check that ``processes`` can run a ``dp x tp`` mesh; returns devices per process.

  Args:
    tp, dp: ``mesh.tp``, ``mesh.dp``.
    processes_per_domain: ``distributed.processes_per_domain``.
    processes: the job's processes (more than one).
    given, given_field: devices per process chosen by the user, and where
      (``devices_per_process``).

  Raises:
    ConfigError: one line naming the field (``devices_per_process``, a domain larger than
      the job, a TP group across domains).
  """
  if processes_per_domain > processes:
    raise ConfigError(f"distributed.processes_per_domain: {processes_per_domain} processes per "
                      f"scale-up domain, but the job has {processes}")
  per_process = devices_per_process(tp * dp, processes, given, given_field)
  check_domains([_StandIn(i // per_process) for i in range(tp * dp)], tp, dp,
                processes_per_domain)
  return per_process


def forced_device_count(xla_flags: str) -> int | None:
  """The CPU device count ``XLA_FLAGS`` sets (the last one), or None."""
  counts = re.findall(rf"{DEVICE_COUNT_FLAG}=(\d+)", xla_flags)
  return int(counts[-1]) if counts else None
