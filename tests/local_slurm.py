"""A single-node SLURM cluster on this machine, for tests: ``munged``, ``slurmctld`` and
``slurmd`` (Debian's ``munge``, ``slurmctld``, ``slurmd``, ``slurm-client``) started in the
foreground from a temporary directory, and stopped by their ids.

No systemd, no cgroups: processes are tracked by their parent ids
(``proctrack/linuxproc``) and not bound to cores (``task/none``). The configuration and logs
go to the directory given; sockets, state and spool to a short one under /tmp (a Unix
socket's path has at most 108 characters), removed at the end; the ports are free ones.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import tempfile
import time

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "sinfo")
# Seconds between scancel's SIGTERM and its SIGKILL: a stop writes a checkpoint in between.
KILL_WAIT_S = 60

SLURM_CONF = """\
ClusterName=ntpjax
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={run}/munge.socket
StateSaveLocation={run}/state
SlurmdSpoolDir={run}/spool
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The node may declare more CPUs than the machine has (two tasks on one core).
SlurmdParameters=config_overrides
ReturnToService=2
KillWait={kill_wait}
# JAX's coordinator port under SLURM follows the job id: start at a random one.
FirstJobId={first_job_id}
NodeName=localhost NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def missing() -> str | None:
  """Why a local cluster cannot run here (one line), or None."""
  absent = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
  if absent:
    return (f"SLURM not installed ({', '.join(absent)} missing; Debian: apt-get install "
            "slurmd slurmctld slurm-client munge)")
  if os.geteuid() != 0:
    return "a local SLURM cluster needs root (slurmd runs its tasks as their user)"
  return None


class LocalSlurm:
  """The cluster's daemons, and the jobs submitted through it.

  ``env``: the environment of its commands, and so of the jobs (``sbatch`` passes it on).
  """

  def __init__(self, workdir, free_port, env):
    self.dir = str(workdir)
    os.makedirs(self.dir, exist_ok=True)
    self.run_dir = tempfile.mkdtemp(prefix="slurm-", dir="/tmp")
    for sub in ("state", "spool"):
      os.makedirs(os.path.join(self.run_dir, sub))
    conf = os.path.join(self.dir, "slurm.conf")
    with open(conf, "w") as f:
      f.write(SLURM_CONF.format(dir=self.dir, run=self.run_dir, ctld_port=free_port(),
                                slurmd_port=free_port(), kill_wait=KILL_WAIT_S,
                                first_job_id=random.randrange(1, 4000)))
    self.env = dict(env, SLURM_CONF=conf)
    self.daemons: list[subprocess.Popen] = []
    self.jobs: list[str] = []

  def start(self, timeout_s: float = 60) -> LocalSlurm:
    """Start munged, slurmctld and slurmd; return once the node takes jobs.

    Raises:
      RuntimeError: a daemon ended, or the node was not idle within ``timeout_s``,
        with the end of the daemons' logs.
    """
    run = self.run_dir
    key = os.path.join(run, "munge.key")
    with open(key, "wb") as f:
      f.write(os.urandom(1024))
    os.chmod(key, 0o600)
    self._spawn("munged", "--foreground", "--force", f"--socket={run}/munge.socket",
                f"--key-file={key}", f"--log-file={self.dir}/munged.log",
                f"--pid-file={run}/munged.pid", f"--seed-file={run}/munged.seed")
    self._spawn("slurmctld", "-D")
    self._spawn("slurmd", "-D", "-N", "localhost")
    deadline = time.monotonic() + timeout_s
    while self.sinfo() != "idle":
      ended = [p.args[0] for p in self.daemons if p.poll() is not None]
      if ended or time.monotonic() > deadline:
        why = f"{', '.join(ended)} ended" if ended else f"node not idle in {timeout_s:g} s"
        raise RuntimeError(f"local SLURM did not start: {why}\n{self.logs()}")
      time.sleep(0.5)
    return self

  def _spawn(self, *command: str) -> None:
    log = open(os.path.join(self.dir, f"{command[0]}.out"), "w")
    self.daemons.append(subprocess.Popen(command, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True))
    log.close()

  def run(self, *command: str, timeout_s: float = 30) -> str:
    """A client command's output (``check``ed)."""
    return subprocess.run(command, env=self.env, capture_output=True, text=True, check=True,
                          timeout=timeout_s).stdout

  def submit(self, *arguments: str) -> str:
    """``sbatch arguments``; returns the job's id."""
    job = self.run("sbatch", "--parsable", *arguments).strip()
    self.jobs.append(job)
    return job

  def sinfo(self) -> str:
    try:
      return self.run("sinfo", "--noheader", "--format=%T", timeout_s=10).strip()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
      return ""

  def running(self, job: str) -> bool:
    """Whether ``job`` is queued, running or ending."""
    return bool(self.run("squeue", "--noheader", f"--jobs={job}", "--format=%T").strip())

  def wait(self, job: str, timeout_s: float) -> float:
    """Seconds until ``job`` left the queue.

    Raises:
      TimeoutError: it is still there after ``timeout_s``.
    """
    start = time.monotonic()
    while self.running(job):
      if time.monotonic() - start > timeout_s:
        raise TimeoutError(f"SLURM job {job} still in the queue after {timeout_s:g} s")
      time.sleep(0.5)
    return time.monotonic() - start

  def logs(self, chars: int = 1500) -> str:
    out = []
    for name in ("slurmctld.log", "slurmd.log", "munged.log"):
      path = os.path.join(self.dir, name)
      if os.path.exists(path):
        out.append(f"--- {name}\n{open(path).read()[-chars:]}")
    return "\n".join(out)

  def stop(self) -> None:
    """Kill the jobs still there (SIGKILL to their tasks), then stop the daemons."""
    try:
      for job in self.jobs:
        if self.running(job):
          self.run("scancel", "--signal=KILL", "--full", job)
      for job in self.jobs:
        self.wait(job, 30)
    except (subprocess.SubprocessError, TimeoutError) as err:  # a daemon gone: stop the rest
      print(f"local SLURM: jobs not cleared ({err})")
    for daemon in reversed(self.daemons):
      if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)
      try:
        daemon.wait(timeout=15)
      except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
    shutil.rmtree(self.run_dir, ignore_errors=True)
