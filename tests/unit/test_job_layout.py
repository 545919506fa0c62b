"""An impossible layout of processes is refused once, by the launcher, before any process
starts (``processes.job_layout``, ``launch.check_command``); and what the launcher prints."""

import io
import os
import sys

import pytest
from helpers import ROOT

from ntp_jax import launch
from ntp_jax.errors import ConfigError
from ntp_jax.processes.job_layout import check_job_layout, forced_device_count

TRAIN = os.path.join(ROOT, "train.py")
TINY = os.path.join(ROOT, "configs", "gpt_tiny.py")


@pytest.mark.parametrize("tp,dp,per_domain,processes,given,error", [
    (8, 1, 1, 16, None, r"^mesh.dp \* mesh.tp: 8 devices for 16 processes; each process needs "
                        r"one at least"),
    (8, 1, 1, 3, None, r"^mesh.dp \* mesh.tp: 8 devices do not split evenly over 3 processes"),
    (4, 2, 3, 2, None, r"^distributed.processes_per_domain: 3 processes per scale-up domain, "
                       r"but the job has 2$"),
    (4, 2, 1, 4, None, r"^mesh.tp: replica 0's 4 slots would span scale-up domains \[0, 1\]"),
    (4, 2, 1, 2, 3, r"^--devices-per-process: 2 processes x 3 devices = 6, fewer than"),
    (4, 2, 1, 3, 4, r"^--devices-per-process: with 4 devices per process, process 2 would hold "
                    r"none of the 8 devices"),
])
def test_impossible_layouts_name_the_field(tp, dp, per_domain, processes, given, error):
  with pytest.raises(ConfigError, match=error):
    check_job_layout(tp, dp, per_domain, processes, given)


def test_possible_layouts_give_each_process_its_devices():
  assert check_job_layout(4, 2, 1, 2) == 4
  assert check_job_layout(4, 2, 2, 4) == 2  # a TP group over a domain of two processes
  assert check_job_layout(4, 2, 4, 8, given=1) == 1
  assert check_job_layout(2, 3, 1, 2, given=4) == 4  # more devices than the mesh: spares
  assert forced_device_count("--a=1 --xla_force_host_platform_device_count=4") == 4
  assert forced_device_count("--a=1") is None


def test_more_processes_than_devices_is_one_line_and_status_2_before_any_starts(
    tmp_path, monkeypatch, capsys):
  def no_start(*args, **kwargs):
    raise AssertionError("a process was started")

  monkeypatch.setattr(launch, "launch", no_start)
  workdir = tmp_path / "run"
  status = launch.main(["--processes", "16", "--", sys.executable, TRAIN, "--config", TINY,
                        f"--config.workdir={workdir}"])
  out, err = capsys.readouterr()
  assert status == 2 and out == ""
  assert err == ("error: mesh.dp * mesh.tp: 8 devices for 16 processes; each process needs "
                 "one at least (use at most 8 processes, or a larger mesh)\n")
  assert not workdir.exists()


def test_the_launcher_reads_the_overrides_and_the_config_file(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(launch, "launch", lambda *args, **kwargs: 0)
  command = [sys.executable, TRAIN, f"--config={TINY}"]
  assert launch.main(["--processes", "2", "--", *command, "--config.mesh.dp=2",
                      "--config.mesh.tp=4"]) == 0
  assert launch.main(["--processes", "4", "--", *command, "--config.mesh.dp=2",
                      "--config.mesh.tp=4"]) == 2
  assert capsys.readouterr().err.startswith("error: mesh.tp: replica 0's 4 slots would span")
  typo = tmp_path / "typo.py"
  typo.write_text("from configs import gpt_tiny\n\ndef get_config():\n"
                  "  config = gpt_tiny.get_config()\n  config.train.stepz = 5\n  return config\n")
  assert launch.main(["--processes", "2", "--", sys.executable, TRAIN, "--config",
                      str(typo)]) == 2
  assert capsys.readouterr().err == (f"error: {typo}: train.stepz: no such config field; did "
                                     "you mean train.steps?\n")
  # Not train.py: the program's own checks speak.
  assert launch.main(["--processes", "16", "--", sys.executable, "-c", "pass"]) == 0


def test_an_error_every_process_prints_is_printed_once_by_the_lowest():
  out = io.StringIO()
  errors = launch.ErrorLines(out, hold_s=0.0)
  for process in (3, 1, 2, 0):
    errors.add(process, "error: data.path: no such file\n")
  errors.add(2, "error: something of process 2's own\n")
  assert errors.summary() == ["[launch] the error of process 0 above was printed alike by 3 "
                              "other process(es): 1-3"]
  assert out.getvalue() == ("[0] error: data.path: no such file\n"
                            "[2] error: something of process 2's own\n")


def test_help_gives_each_default_once(capsys):
  with pytest.raises(SystemExit):
    launch.main(["--help"])
  text = capsys.readouterr().out
  assert "(default: None)" not in text
  assert " ".join(text.split()).count("(default: 60)") == 1


def test_a_recoverable_job_of_one_process_is_refused():
  from helpers import micro_config

  from ntp_jax.processes.distributed import join
  from ntp_jax.training.config import RunConfig
  config = micro_config("/tmp/unused", **{"distributed.recoverable": True})
  with pytest.raises(ConfigError, match=r"^distributed.recoverable: True needs a job of several "
                     r"processes"):
    join(RunConfig.from_config(config).distributed)
