"""Multi-process runs: ``jax.distributed`` set-up, device order, scale-up domains.

JAX's multi-controller runtime is the engine: every process runs the same
program, drives its own (local) devices, and takes part in exactly the
compiled programs whose meshes hold some of them. This module

- starts it from the config (``distributed.coordinator`` /
  ``num_processes`` / ``process_id``, the ``NTP_JAX_*`` variables that
  ``python -m ntp_jax.launch`` sets, or, with none of them, the cluster
  environments ``jax.distributed.initialize()`` detects: SLURM, Open MPI, ...),
  with gloo collectives on CPU;
- orders the job's devices so that every TP group lies inside one scale-up
  domain (``distributed.processes_per_domain`` consecutive processes; one
  host's local devices by default);
- starts the watch on the other processes (``processes.heartbeat``): when
  one dies or stops answering, every survivor stops within
  ``distributed.heartbeat_timeout_s`` with one line naming it, rather than
  hanging in a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
from collections.abc import Sequence
from typing import Any

import jax

from ntp_jax.errors import ConfigError
from ntp_jax.processes.heartbeat import Heartbeat, StopAgreement, is_done
from ntp_jax.processes.launcher_watch import watch_launcher
from ntp_jax.processes.links import Links, local_address
from ntp_jax.processes.service import ENV_EXTERNAL_SERVICE, no_service_in_process_0

ENV_COORDINATOR = "NTP_JAX_COORDINATOR"  # set by ntp_jax.launch for each process it starts
ENV_NUM_PROCESSES = "NTP_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "NTP_JAX_PROCESS_ID"
# Process counts of the launchers whose settings jax.distributed.initialize() detects by
# itself: srun's job step (not sbatch's batch script) and Open MPI's mpirun.
CLUSTER_PROCESS_COUNTS = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")
# What JAX's fault-tolerance guide (docs.jax.dev, "Fault Tolerant Distributed JAX") sets on
# GPU so that a collective with a dead peer can be cancelled, not wait in NCCL for ever.
GPU_RECOVERY_FLAGS = {"--xla_gpu_nccl_terminate_on_error": "false",
                      "--xla_gpu_nccl_async_execution": "true",
                      "--xla_gpu_nccl_blocking_communicators": "false"}
GPU_RECOVERY_ENV = {"XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": "1"}
CPU_COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"
# Packages of JAX's GPU plugins: one importable means the job runs on GPUs.
_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                "jax_rocm7_plugin")


@dataclasses.dataclass(frozen=True)
class Settings:
  """How this process joins the job.

  ``coordinator``/``num_processes``/``process_id`` are None when
  ``jax.distributed.initialize`` detects them (a cluster environment).
  """

  coordinator: str | None
  num_processes: int | None
  process_id: int | None
  heartbeat_timeout_s: float
  processes_per_domain: int
  recoverable: bool = False
  collective_timeout_s: float = 0.0  # 0: collective_timeout_s(heartbeat_timeout_s)
  external_service: bool = False  # JAX's coordination service runs outside the workers
  # The devices this process drives: None JAX's choice, () every device it sees, or ids
  local_device_ids: tuple[int, ...] | None = None


def local_device_ids(text: str) -> tuple[int, ...] | None:
  """``distributed.local_device_ids``: ``""`` -> None (JAX's choice: under SLURM or Open MPI
  on GPU, the one device of the process's local rank), ``"all"`` -> ``()`` (no restriction:
  every device the process sees), ``"0,1"`` -> ``(0, 1)``.

  Raises:
    ConfigError: anything else, naming the field.
  """
  text = text.strip()
  if not text:
    return None
  if text == "all":
    return ()
  try:
    ids = tuple(int(part) for part in text.split(","))
  except ValueError:
    ids = ()
  if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
    raise ConfigError(f"distributed.local_device_ids: expected \"\", \"all\" or distinct "
                      f"device ids like \"0,1\", got {text!r}")
  return ids


def settings_from_config(distributed: Any, environ: dict[str, str] | None = None
                         ) -> Settings | None:
  """The multi-process settings of the ``distributed`` section, or None for one process.

  Args:
    distributed: ``training.config.DistributedConfig`` (its ranges checked there).
    environ: the environment (default ``os.environ``).

  Order: the config fields, then ``NTP_JAX_*`` (the local launcher), then a
  cluster launcher's environment (``srun`` with ``SLURM_STEP_NUM_TASKS`` > 1,
  ``mpirun``) left to JAX's detection.

  Raises:
    ConfigError: an incomplete or inconsistent setting, naming the field.
  """
  env = os.environ if environ is None else environ
  coordinator = distributed.coordinator or env.get(ENV_COORDINATOR, "")
  num = int(distributed.num_processes or env.get(ENV_NUM_PROCESSES, 0) or 0)
  pid = distributed.process_id
  pid = int(env.get(ENV_PROCESS_ID, -1)) if pid < 0 else pid
  timeout, per_domain = distributed.heartbeat_timeout_s, distributed.processes_per_domain
  if coordinator or num > 1:
    if not coordinator:
      raise ConfigError("distributed.coordinator: required with distributed.num_processes="
                        f"{num} (host:port of process 0)")
    if ":" not in coordinator:
      raise ConfigError(f"distributed.coordinator: expected host:port, got {coordinator!r}")
    if num < 1:
      raise ConfigError(f"distributed.num_processes: required with distributed.coordinator="
                        f"{coordinator}, got {num}")
    if not 0 <= pid < num:
      raise ConfigError(f"distributed.process_id: must be in 0..{num - 1}, got {pid}")
    return Settings(coordinator, num, pid, timeout, per_domain, distributed.recoverable,
                    distributed.collective_timeout_s, _external_service(distributed, env),
                    local_device_ids(getattr(distributed, "local_device_ids", "")))
  if num == 1:
    return None
  if _cluster_processes(env) > 1:
    return Settings(None, None, None, timeout, per_domain, distributed.recoverable,
                    distributed.collective_timeout_s, _external_service(distributed, env),
                    local_device_ids(getattr(distributed, "local_device_ids", "")))
  return None


def _external_service(distributed: Any, env) -> bool:
  """Whether the coordination service runs outside the workers: ``distributed.
  external_coordinator``, or ``python -m ntp_jax.launch`` hosting it."""
  return bool(distributed.external_coordinator) or env.get(ENV_EXTERNAL_SERVICE) == "1"


def _cluster_processes(env) -> int:
  """Processes a cluster launcher started (1 when none did)."""
  return max([int(env.get(v) or 1) for v in CLUSTER_PROCESS_COUNTS])


def processes_in_config(distributed: Any, environ: dict[str, str] | None = None) -> int:
  """How many processes the run will have, as far as known before JAX starts (1 if unknown).

  ``distributed``: ``training.config.DistributedConfig``."""
  settings = settings_from_config(distributed, environ)
  if settings is None:
    return 1
  if settings.num_processes is not None:
    return settings.num_processes
  return _cluster_processes(os.environ if environ is None else environ)


def expects_gpu(environ: dict[str, str] | None = None) -> bool:
  """Will this process's JAX run on GPUs? Read before its backend starts: ``JAX_PLATFORMS``
  when set, else whether a GPU plugin of JAX is installed."""
  env = os.environ if environ is None else environ
  platforms = env.get("JAX_PLATFORMS", "").lower()
  if platforms:
    return any(p in platforms for p in ("cuda", "gpu", "rocm"))
  return any(importlib.util.find_spec(name) is not None for name in _GPU_PLUGINS)


def gpu_recovery_environment(environ: dict[str, str]) -> tuple[dict[str, str], list[str]]:
  """The variables a recoverable GPU job needs set (``GPU_RECOVERY_FLAGS`` in
  ``XLA_FLAGS``, ``GPU_RECOVERY_ENV``), and the names of those it adds.

  Args:
    environ: the environment as it is (read only).

  Raises:
    ConfigError: ``XLA_FLAGS`` or the environment already sets one of them otherwise
      (survivors would hang in NCCL), naming it and ``distributed.recoverable``.
  """
  flags = environ.get("XLA_FLAGS", "").split()
  given = dict(f.split("=", 1) for f in flags if "=" in f)
  added = []
  for flag, value in GPU_RECOVERY_FLAGS.items():
    if flag not in given:
      flags.append(f"{flag}={value}")
      added.append(f"{flag}={value}")
    elif given[flag].lower() != value:
      raise ConfigError(f"distributed.recoverable: XLA_FLAGS sets {flag}={given[flag]}, but a "
                        f"recoverable GPU job needs {flag}={value} (JAX's fault-tolerance "
                        "guide): survivors of a lost process would hang in NCCL")
  update = {"XLA_FLAGS": " ".join(flags)}
  for name, value in GPU_RECOVERY_ENV.items():
    if name not in environ:
      update[name] = value
      added.append(f"{name}={value}")
    elif environ[name] != value:
      raise ConfigError(f"distributed.recoverable: {name}={environ[name]} is set, but a "
                        f"recoverable GPU job needs {name}={value} (JAX's fault-tolerance "
                        "guide)")
  return update, added


def collective_timeout_s(settings: Settings) -> int:
  """Seconds a CPU collective waits for its peers in a recoverable job (XLA's
  ``--xla_cpu_collective_timeout_seconds``, 1800 by default): ``collective_timeout_s`` when
  set, else twice the heartbeat's timeout, at least 10 s.

  Gloo tells a dead process's neighbours at once ("connection closed") but leaves every
  other participant waiting until this bound, after which its step raises and the loss is
  taken over; the heartbeat names the peer meanwhile. A healthy wait must stay below it:
  processes compile a step's programs before they arrive at it
  (``TrainingRun._compile_before_arriving``), but one process's step can still lag another's
  by seconds where processes share few cores.
  """
  if settings.collective_timeout_s:
    return math.ceil(settings.collective_timeout_s)
  return max(10, math.ceil(2 * settings.heartbeat_timeout_s))


def jax_heartbeat_s(settings: Settings) -> int:
  """JAX's own heartbeat timeout (its service declares a silent process dead after it).

  Well above ``heartbeat_timeout_s`` (3 x + 30 s), so that ours names a lost process first
  and the survivors have time for a just-in-time checkpoint before JAX ends them; in a
  recoverable GPU job JAX ends no survivor, and a collective with a dead peer is cancelled
  only once JAX's service has declared that peer dead: there it is the collective bound of
  a CPU job, ``collective_timeout_s`` (not measured: no GPU here).
  """
  if settings.recoverable and expects_gpu():
    return collective_timeout_s(settings)
  return int(3 * settings.heartbeat_timeout_s + 30)


def cpu_collective_environment(environ: dict[str, str], settings: Settings) -> dict[str, str]:
  """``XLA_FLAGS`` with the collective bound of ``collective_timeout_s`` added (kept when
  already given)."""
  flags = environ.get("XLA_FLAGS", "").split()
  if any(f.startswith(CPU_COLLECTIVE_TIMEOUT_FLAG + "=") for f in flags):
    return {}
  flags.append(f"{CPU_COLLECTIVE_TIMEOUT_FLAG}={collective_timeout_s(settings)}")
  return {"XLA_FLAGS": " ".join(flags)}


def initialize(settings: Settings) -> str | None:
  """Join the job: ``jax.distributed.initialize`` (gloo collectives on CPU).

  JAX's own heartbeat is set well above ``heartbeat_timeout_s`` so that the
  ``Heartbeat`` watchdog, which names the lost process, speaks first, and the
  survivors have time for a just-in-time checkpoint before JAX ends them. With
  ``recoverable``, ``jax_enable_recoverability`` is set first: JAX then ends no
  survivor when it finds a process lost; on GPU the NCCL settings of JAX's
  fault-tolerance guide too (``gpu_recovery_environment``), on CPU a bound on every
  collective's wait (``collective_timeout_s``), before the backend reads them. With
  ``external_service`` process 0 joins a coordination service that runs elsewhere
  (``processes.service``) instead of starting one. Returns the line saying what it set,
  or None.

  Raises:
    ConfigError: a setting that contradicts recoverable mode on GPU.
  """
  # CPU collectives across processes need gloo; harmless where another platform is used.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  note = None
  if settings.recoverable:
    if expects_gpu():
      update, added = gpu_recovery_environment(os.environ)
      os.environ.update(update)
      note = ("distributed.recoverable on GPU: "
              + (", ".join(added) if added else "the NCCL settings were set already")
              + " (collectives with a lost peer are cancelled, not waited on)")
    else:  # before the CPU backend starts: it reads the flag once
      os.environ.update(cpu_collective_environment(os.environ, settings))
    jax.config.update("jax_enable_recoverability", True)
  # With the service outside (processes.service), process 0 joins it as a client only.
  with no_service_in_process_0() if settings.external_service else contextlib.nullcontext():
    # An empty list is not None, so JAX's cluster detection leaves it: no restriction.
    ids = None if settings.local_device_ids is None else list(settings.local_device_ids)
    jax.distributed.initialize(
        settings.coordinator, settings.num_processes, settings.process_id,
        local_device_ids=ids, heartbeat_timeout_seconds=jax_heartbeat_s(settings))
  return note


def ordered_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
  """The job's devices by (process, local id): a process's devices are consecutive.

  ``mesh.device_for_slot`` numbers slots replica-major over this order, so a
  replica's TP group lies in as few processes as possible.
  """
  devices = list(jax.devices() if devices is None else devices)
  return sorted(devices, key=lambda d: (d.process_index, d.id))


def check_domains(devices: Sequence[jax.Device], tp: int, dp: int,
                  processes_per_domain: int) -> None:
  """Every TP group must lie inside one scale-up domain.

  A domain is ``processes_per_domain`` consecutive processes (one host's
  local devices by default); the TP collectives run over NVLink there.

  Raises:
    ConfigError: a replica's slots would span two domains, naming the fields.
  """
  for replica in range(dp):
    group = devices[replica * tp:(replica + 1) * tp]
    domains = {d.process_index // processes_per_domain for d in group}
    if len(domains) > 1:
      per_process = len([d for d in devices if d.process_index == group[0].process_index])
      raise ConfigError(
          f"mesh.tp: replica {replica}'s {tp} slots would span scale-up domains "
          f"{sorted(domains)} ({per_process} devices per process, "
          f"distributed.processes_per_domain={processes_per_domain}); set "
          f"distributed.processes_per_domain to {-(-tp // max(1, per_process))} or lower mesh.tp")


@dataclasses.dataclass
class Job:
  """This process's place in the job (a single-process run is process 0 of 1)."""

  process_id: int = 0
  num_processes: int = 1
  heartbeat: Heartbeat | None = None
  processes_per_domain: int = 1
  client: object | None = None  # the coordination service's key-value client
  recoverable: bool = False  # survivors of a lost process go on (distributed.recoverable)
  jit_checkpoint_s: float = 0.0  # else they write the last step first (0: they do not)
  notes: tuple[str, ...] = ()  # lines for the run's log: what joining set
  external_service: bool = False  # JAX's coordination service runs in no worker
  links: Links | None = None  # a dead peer named at once (processes.links)
  lost: set[int] = dataclasses.field(default_factory=set)  # processes lost, gone on without

  @property
  def speaker(self) -> bool:
    """This process speaks for the job (the log, the metrics, the plot): the lowest live one."""
    return self.process_id == min(set(range(self.num_processes)) - self.lost)

  def stop_agreement(self) -> StopAgreement | None:
    return StopAgreement(self.client) if self.multi_process else None

  @property
  def primary(self) -> bool:
    return self.process_id == 0

  @property
  def multi_process(self) -> bool:
    return self.num_processes > 1

  def finish(self) -> None:
    """The end of a run that finished here: the heartbeat stops (the peers do not miss this
    process), and in recoverable mode the processes leave the job in order.

    JAX's coordination service leaves recoverable tasks out of its shutdown barrier, so
    process 0 (which hosts the service) could close it while another process's shutdown
    is under way, and JAX would abort that one (status 134) after a clean run. So every
    other process shuts its client down here, and process 0 returns only once each live
    one has (``get_live_nodes`` waits for a live process that has not left; a lost one is
    waited for until the service's own heartbeat declares it dead).
    """
    if self.heartbeat is not None:
      self.heartbeat.stop()  # marks this process done: its closing links are no loss
    if self.links is not None:
      self.links.close()
    if not (self.multi_process and self.recoverable):
      return
    if not self.primary or self.external_service:  # the service outlives every worker
      jax.distributed.shutdown()
      return
    lost = self.heartbeat.lost_processes if self.heartbeat is not None else set()
    self.client.get_live_nodes(sorted(set(range(self.num_processes)) - lost))


_JOINED: Job | None = None


# gloo's own bound (its contexts' default timeout), on the waits XLA's CPU collective bound
# does not reach: a reduce-scatter (``ReduceScatterHalvingDoubling``, given no timeout) and
# the connection of a new communicator to its peers.
GLOO_TIMEOUT_S = 30


def _takeover_s(settings: Settings) -> float:
  """Seconds the main thread gets to take a loss over: a third of the heartbeat's timeout
  (between steps it is waiting at an arrival), and in a recoverable job also twice the
  longest bound of a collective, after which a step's collective raises: on GPU
  ``collective_timeout_s`` (JAX's heartbeat cancels it after as long), on CPU the longer of
  that (XLA's bound) and gloo's own (``GLOO_TIMEOUT_S``: a reduce-scatter, a connection).
  Twice: a survivor released from its own collective then waits in the phase's vote for a
  peer that entered its collective later and is released as late (seen in a ``--pair``
  chaos trial, 4 x 2: once past 30 s)."""
  base = settings.heartbeat_timeout_s / 3 + 1.0
  if not settings.recoverable:
    return base
  bound = collective_timeout_s(settings)
  return base + 2 * (bound if expects_gpu() else max(bound, GLOO_TIMEOUT_S))


def join(distributed: Any) -> Job:
  """Start ``jax.distributed`` if the ``distributed`` section (``DistributedConfig``) or the
  environment asks for several processes, and the heartbeat.

  Must run before any JAX computation; a second call returns the same
  ``Job``. A single-process config returns ``Job()`` and touches nothing. Under
  ``python -m ntp_jax.launch`` it also starts the watch on the launcher
  (``launcher_watch``): a process whose launcher died stops itself.

  Raises:
    ConfigError: bad ``distributed.*`` settings, naming the field (``distributed.recoverable``
      in a job of one process, too).
  """
  global _JOINED
  if _JOINED is not None:
    return _JOINED
  settings = settings_from_config(distributed)
  if distributed.recoverable and (settings is None or settings.num_processes == 1):
    raise ConfigError("distributed.recoverable: True needs a job of several processes (this "
                      "run is one: no peer to go on without)")
  watch_launcher()  # before joining, which waits for every process
  if settings is None:
    return Job()
  note = initialize(settings)
  from jax._src import distributed as jax_distributed  # the runtime's key-value client

  heartbeat = links = None
  notes = [note] if note else []
  takes_over = settings.recoverable or distributed.jit_checkpoint_s > 0
  if jax.process_count() > 1:
    # The main thread takes over a loss at the next step boundary (it goes on, or writes a
    # just-in-time checkpoint); a main thread stuck in a collective does not: then the
    # heartbeat ends the process itself, after a short grace.
    heartbeat = Heartbeat(jax_distributed.global_state.client, jax.process_index(),
                          jax.process_count(), settings.heartbeat_timeout_s,
                          takeover_s=_takeover_s(settings) if takes_over else None).start()
    client = jax_distributed.global_state.client

    def closed(peer: int, why: str) -> None:
      # A process 0 that hosts the coordination service takes it along when it dies, and
      # JAX's client then ends every other process itself (the launcher says so): no race.
      if peer != 0 or settings.external_service:
        heartbeat.report_closed(peer, why)

    try:
      links = Links(client, jax.process_index(), jax.process_count(), closed,
                    lambda peer: is_done(client, peer),
                    local_address(jax_distributed.global_state.coordinator_address))
      unlinked = links.connect()
    except Exception as err:  # noqa: BLE001 -- the heartbeat still watches every peer
      links, unlinked = None, [f"this process: {type(err).__name__}: {err}"]
    if unlinked:
      notes.append(f"liveness links: none to {len(unlinked)} process(es), whose loss the "
                   f"heartbeat alone finds ({'; '.join(unlinked[:3])})")
  _JOINED = Job(jax.process_index(), jax.process_count(), heartbeat,
                settings.processes_per_domain, jax_distributed.global_state.client,
                settings.recoverable, distributed.jit_checkpoint_s,
                tuple(notes), settings.external_service, links)
  return _JOINED
