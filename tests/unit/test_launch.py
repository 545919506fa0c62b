"""``python -m ntp_jax.launch`` passes its processes' output through, less gloo's chatter."""

import dataclasses
import io
import sys
import time

import pytest
from helpers import micro_config

from ntp_jax.launch import _pump, is_chatter, strip_chatter

CHATTER = ("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks "
           "is : 1\n")


def test_only_gloo_connection_lines_are_chatter():
  assert is_chatter(CHATTER)
  assert is_chatter(CHATTER.replace("Rank 0", "Rank 3").replace("1", "7"))
  for line in ("step 0/150 | loss 7.6501 | compile + step 4.8 s | TP degree 8\n",
               "[Gloo] Rank 0 lost its connection\n",
               "error: lost process 1 of 2: no heartbeat for 30.0 s\n",
               "note: " + CHATTER):
    assert not is_chatter(line), line


def test_pump_prefixes_every_line_but_the_chatter():
  out = io.StringIO()
  _pump(io.BytesIO(f"plan: 2 DP replica(s)\n{CHATTER}step 0/3 | loss 7.6\n".encode()), "[1] ",
        out)
  assert out.getvalue() == "[1] plan: 2 DP replica(s)\n[1] step 0/3 | loss 7.6\n"


def test_a_line_cut_off_by_a_kill_still_ends_its_line():
  """A process killed while writing leaves half a line: the launcher's next words must not
  run on from it."""
  out = io.StringIO()
  _pump(io.BytesIO(b"step 5/16 | loss 6.19 | TP degree 2,2"), "[0] ", out)
  assert out.getvalue() == "[0] step 5/16 | loss 6.19 | TP degree 2,2\n"


# Process 1 fails at once; process 0 ends by itself after a second (or never, with "hang").
_SCRIPT = ("import os, sys, time\n"
           "if os.environ['NTP_JAX_PROCESS_ID'] == '1': sys.exit(3)\n"
           "time.sleep(1 if sys.argv[1] == 'end' else 600)\n")


def test_the_others_get_their_time_then_the_first_failure_is_the_status():
  from ntp_jax.launch import launch
  start = time.monotonic()
  assert launch([sys.executable, "-c", _SCRIPT, "hang"], 2, survivor_s=0.5, grace_s=1) == 3
  assert time.monotonic() - start < 30


def test_with_run_on_the_survivors_finish_and_their_status_is_the_jobs():
  from ntp_jax.launch import launch
  assert launch([sys.executable, "-c", _SCRIPT, "end"], 2, run_on=True) == 0


# Processes 2 and 3 fail at once, process 1 later; process 0 ends last: its status is the job's.
_THREE_FAIL = ("import os, sys, time\n"
               "i = int(os.environ['NTP_JAX_PROCESS_ID'])\n"
               "time.sleep({0: 1.5, 1: 1.0}.get(i, 0))\n"
               "sys.exit({0: int(sys.argv[1]), 1: 7}.get(i, 9))\n")


@pytest.mark.parametrize("last", [0, 5])
def test_with_run_on_every_failure_is_said_and_the_last_to_end_gives_the_status(last, capsys):
  from ntp_jax.launch import launch
  assert launch([sys.executable, "-c", _THREE_FAIL, str(last)], 4, run_on=True) == last
  said = [line for line in capsys.readouterr().err.splitlines() if "the others run on" in line]
  assert sorted(said) == sorted([f"[launch] process {i} exited with status {c}; the others run on"
                                 for i, c in ((1, 7), (2, 9), (3, 9))] + (
      [f"[launch] process 0 exited with status {last}; the others run on"] if last else []))


def test_interleaved_pieces_of_two_chatter_lines_go_too():
  """Several gloo threads write their lines in pieces at once (seen with 2 processes)."""
  mixed = ["[Gloo] Rank 1 is connected to [Gloo] Rank 3 is connected to 3 peer ranks. Expected "
           "number of connected peer ranks is : 3\n",
           "3 peer ranks. Expected number of connected peer ranks is : 3\n",
           "[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks "
           "is : 3[Gloo] Rank 3 is connected to 3 peer ranks. Expected number of connected peer "
           "ranks is : 3\n"]
  for line in mixed:
    assert strip_chatter(line) is None, line
  assert strip_chatter("3\n", after_chatter=True) is None
  assert strip_chatter("3\n") == "3\n"  # a number of the program's own
  assert strip_chatter("step 2/8 | loss 7.6[Gloo] Rank 0 is connected to \n") == (
      "step 2/8 | loss 7.6\n")


def test_recoverable_mode_on_gpu_adds_the_nccl_settings_and_refuses_contrary_ones():
  from ntp_jax.errors import ConfigError
  from ntp_jax.processes.distributed import (
    GPU_RECOVERY_ENV,
    GPU_RECOVERY_FLAGS,
    expects_gpu,
    gpu_recovery_environment,
  )
  assert expects_gpu({"JAX_PLATFORMS": "cuda"}) and not expects_gpu({"JAX_PLATFORMS": "cpu"})
  update, added = gpu_recovery_environment({"XLA_FLAGS": "--xla_gpu_nccl_async_execution=true"})
  flags = update["XLA_FLAGS"].split()
  assert sorted(flags) == sorted(f"{k}={v}" for k, v in GPU_RECOVERY_FLAGS.items())
  assert "--xla_gpu_nccl_async_execution=true" not in added  # it was there already
  assert update["XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE"] == "1"
  assert set(GPU_RECOVERY_ENV) <= set(update) and len(added) == 3
  with pytest.raises(ConfigError, match=r"^distributed.recoverable: XLA_FLAGS sets "
                     r"--xla_gpu_nccl_terminate_on_error=true, but .* needs "
                     r"--xla_gpu_nccl_terminate_on_error=false"):
    gpu_recovery_environment({"XLA_FLAGS": "--xla_gpu_nccl_terminate_on_error=true"})
  with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE=0"):
    gpu_recovery_environment({"XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE": "0"})


class _Client:
  def __init__(self):
    self.calls = []

  def get_live_nodes(self, processes):
    self.calls.append(("get_live_nodes", list(processes)))
    return {p: 0 for p in processes}


class _Heartbeat:
  def __init__(self, lost):
    self.lost_processes, self.stopped = set(lost), False

  def stop(self):
    self.stopped = True


@pytest.mark.parametrize("process", [0, 2])
def test_in_recoverable_mode_process_0_leaves_the_job_last(process, monkeypatch):
  """The service's shutdown barrier leaves recoverable tasks out: process 0 (its host) must
  not close it while another is shutting down, so it waits for every live one to leave."""
  import jax

  from ntp_jax.processes.distributed import Job
  shut = []
  monkeypatch.setattr(jax.distributed, "shutdown", lambda: shut.append(process))
  client, heartbeat = _Client(), _Heartbeat(lost={3})
  Job(process, 4, heartbeat, client=client, recoverable=True).finish()
  assert heartbeat.stopped
  if process == 0:  # waits for 1 and 2 to leave (3 was lost), then leaves at exit
    assert client.calls == [("get_live_nodes", [0, 1, 2])] and shut == []
  else:  # leaves at once, while the service still runs
    assert client.calls == [] and shut == [process]
  client, heartbeat = _Client(), _Heartbeat(lost=())
  Job(process, 4, heartbeat, client=client, recoverable=False).finish()  # JAX's barrier
  assert heartbeat.stopped and client.calls == [] and shut == ([] if process == 0 else [2])


def test_recoverable_cpu_collectives_are_bounded_from_the_heartbeat():
  """A recoverable CPU job bounds gloo's waits (``--xla_cpu_collective_timeout_seconds``):
  twice the heartbeat's timeout, at least 10 s, or ``distributed.collective_timeout_s``; a
  bound already in ``XLA_FLAGS`` stands."""
  from ntp_jax.processes.distributed import (
    Settings,
    collective_timeout_s,
    cpu_collective_environment,
  )
  settings = Settings("127.0.0.1:1", 2, 0, heartbeat_timeout_s=4.0, processes_per_domain=1,
                      recoverable=True)
  assert collective_timeout_s(settings) == 10
  assert collective_timeout_s(dataclasses.replace(settings, heartbeat_timeout_s=30.0)) == 60
  assert collective_timeout_s(dataclasses.replace(settings, collective_timeout_s=2.5)) == 3
  flags = cpu_collective_environment({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
                                     settings)["XLA_FLAGS"].split()
  assert flags == ["--xla_force_host_platform_device_count=4",
                   "--xla_cpu_collective_timeout_seconds=10"]
  assert cpu_collective_environment(
      {"XLA_FLAGS": "--xla_cpu_collective_timeout_seconds=99"}, settings) == {}


def test_process_0_joins_an_outside_service_as_a_client_only():
  """Inside ``no_service_in_process_0`` JAX's runtime starts no coordination service (the
  launcher or ``python -m ntp_jax.coordinator`` hosts it); everything else is JAX's own."""
  from jax._src import distributed as jax_distributed

  from ntp_jax.processes.service import no_service_in_process_0
  runtime = jax_distributed._jax
  with no_service_in_process_0():
    stand_in = jax_distributed._jax.get_distributed_runtime_service("[::]:1", 2)
    stand_in.shutdown()  # nothing to end
    assert jax_distributed._jax.get_distributed_runtime_client is (
        runtime.get_distributed_runtime_client)
  assert jax_distributed._jax is runtime


def test_jax_heartbeat_is_ours_with_room_except_in_a_recoverable_gpu_job(monkeypatch):
  """JAX's heartbeat speaks after ours (3 x + 30 s); in a recoverable GPU job it is the
  collective bound, after which a collective with a dead peer is cancelled."""
  from ntp_jax.processes.distributed import Settings, jax_heartbeat_s
  settings = Settings("127.0.0.1:1", 2, 0, heartbeat_timeout_s=5.0, processes_per_domain=1,
                      recoverable=True)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert jax_heartbeat_s(settings) == 45
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  assert jax_heartbeat_s(settings) == 10
  assert jax_heartbeat_s(dataclasses.replace(settings, recoverable=False)) == 45


def test_local_device_ids_reach_jax_distributed_and_bad_ones_are_one_line(monkeypatch):
  """``distributed.local_device_ids``: "" leaves JAX's choice (under SLURM or Open MPI on GPU,
  the local rank's one device), "all" lifts it (an empty list, which JAX's cluster detection
  leaves alone), ids pass as they are; anything else is one line naming the field."""
  import jax

  from ntp_jax.errors import ConfigError
  from ntp_jax.processes import distributed
  from ntp_jax.training.config import RunConfig
  seen = []
  monkeypatch.setattr(jax.distributed, "initialize",
                      lambda *args, **kwargs: seen.append(kwargs["local_device_ids"]))
  srun = {"SLURM_STEP_NUM_TASKS": "2"}
  for text, ids in [("", None), ("all", []), ("0,2", [0, 2])]:
    config = micro_config("/tmp/unused", **{"distributed.local_device_ids": text})
    settings = distributed.settings_from_config(RunConfig.from_config(config).distributed, srun)
    distributed.initialize(settings)
    assert seen[-1] == ids, text
  for bad in ("gpu0", "1,1", "-1"):
    with pytest.raises(ConfigError, match=f"^distributed.local_device_ids: .*got '{bad}'$"):
      RunConfig.from_config(micro_config("/tmp/unused", **{"distributed.local_device_ids": bad}))
