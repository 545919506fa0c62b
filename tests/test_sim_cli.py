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


def test_simulator_does_not_import_jax():
  code = ("import sys, ntp_jax.sim, ntp_jax.sim.cli, ntp_jax.sim.plots; "
          "print('jax' in sys.modules)")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
  assert result.stdout.strip() == "False"
