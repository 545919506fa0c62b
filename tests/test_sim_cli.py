"""Command line of the simulator (python -m ntp_jax.sim)."""

import json
import subprocess
import sys

import pytest

from ntp_jax.sim.cli import main

SMALL = ["--gpus", "2048", "--tp", "32", "--pp", "4"]


def test_sweep_writes_table_files_and_plot(tmp_path, capsys):
  assert main(["sweep", *SMALL, "--samples", "50", "--points", "3", "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "dp-drop" in out and "mean_loss_pct" in out
  for name in ("loss_sweep.csv", "loss_sweep.json", "loss_sweep.png"):
    assert (tmp_path / name).stat().st_size > 0


def test_timeline_json_on_stdout(tmp_path, capsys):
  main(["timeline", *SMALL, "--days", "2", "--format", "json", "--out", str(tmp_path)])
  rows = json.loads(capsys.readouterr().out)
  assert [r["policy"] for r in rows] == ["dp-drop", "ntp", "ntp-pw"]
  assert (tmp_path / "timeline.png").exists() and (tmp_path / "timeline.csv").exists()


def test_spares_csv_on_stdout(tmp_path, capsys):
  main(["spares", *SMALL, "--days", "2", "--max-spares", "12", "--format", "csv",
        "--out", str(tmp_path)])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "policy,spares_needed,per_gpu_throughput,running_with_no_spares"
  assert (tmp_path / "spares.png").exists()


def test_plan_lists_degraded_replicas(capsys):
  main(["plan", *SMALL, "--failed", "3:1", "--policies", "ntp", "--format", "json"])
  (row,) = json.loads(capsys.readouterr().out)
  assert (row["degree"], row["batch_share"]) == (31, 31 / 32)


def test_bad_arguments_exit_with_usage():
  with pytest.raises(SystemExit):
    main(["sweep", "--gpus", "100"])
  with pytest.raises(SystemExit):
    main(["sweep", "--policies", "nope"])


def _usage_error(argv, capsys) -> str:
  """Stderr of ``main(argv)``, which must exit with argparse's usage error."""
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  assert exit_info.value.code == 2
  return capsys.readouterr().err


def test_bad_failed_pair_names_the_format(capsys):
  err = _usage_error(["plan", *SMALL, "--failed", "0:1,x"], capsys)
  assert ("argument --failed: 'x' is not domain:count (failed GPUs in a domain), e.g. 0:1,17:2"
          in err)


def test_bad_policy_lists_the_policies(capsys):
  err = _usage_error(["sweep", "--policies", "ntp,foo"], capsys)
  assert "argument --policies: 'foo' is not a policy; choose from dp-drop, ntp, ntp-pw" in err
  assert "_policy_list" not in err
  err = _usage_error(["sweep", "--policies", ","], capsys)
  assert "give at least one policy of dp-drop, ntp, ntp-pw" in err


def test_bad_number_lists_say_what_is_expected(capsys):
  err = _usage_error(["sweep", "--degrees", "32,a"], capsys)
  assert "argument --degrees: '32,a' is not a comma list of integers, e.g. 32,30,28" in err
  err = _usage_error(["sweep", "--fractions", "x"], capsys)
  assert "argument --fractions: 'x' is not a comma list of numbers" in err


@pytest.mark.parametrize("argv, message", [
    (["sweep", "--gpus", "100"], "num_gpus: 100 is not a multiple of tp * pp = 256"),
    (["plan", *SMALL, "--failed", "999:1"], "domain 999 is outside [0, 64)"),
    (["timeline", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_errors_show_the_sub_command_usage(argv, message, capsys):
  err = _usage_error(argv, capsys)
  command = argv[0]
  assert err.startswith(f"usage: python -m ntp_jax.sim {command} [-h]")
  assert f"python -m ntp_jax.sim {command}: error: {message}" in err


def test_spares_explains_dash_in_footnote(capsys):
  main(["spares", *SMALL, "--days", "2", "--max-spares", "0", "--policies", "dp-drop"])
  lines = capsys.readouterr().out.splitlines()
  assert lines[-2].split() == ["dp-drop", "-", "-", "0"]
  assert lines[-1] == ("# -: the job still pauses with --max-spares 0 spares; "
                       "raise --max-spares to try more")


def test_spares_without_dash_has_no_footnote(capsys):
  main(["spares", *SMALL, "--days", "2", "--max-spares", "0", "--policies", "ntp-pw"])
  assert "# -:" not in capsys.readouterr().out


@pytest.mark.parametrize("command, option, text", [
    ("sweep", "--max-fraction", "largest failed fraction without --fractions (default: 0.004)"),
    ("sweep", "--points", "evenly spaced fractions from 0 to --max-fraction (default: 9)"),
    ("spares", "--max-spares", "spares_needed is - when even these do not keep the job running"),
])
def test_options_have_help(command, option, text, capsys):
  with pytest.raises(SystemExit):
    main([command, "--help"])
  out = " ".join(capsys.readouterr().out.split())
  assert f"{option} {option[2:].upper().replace('-', '_')} " in out
  assert text in out


def test_simulator_does_not_import_jax():
  code = ("import sys, ntp_jax.sim, ntp_jax.sim.cli, ntp_jax.sim.plots; "
          "print('jax' in sys.modules)")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
  assert result.stdout.strip() == "False"
