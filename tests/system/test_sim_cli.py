"""Command line of the simulator (python -m ntp_jax.sim)."""

import json
import re
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
  main(["plan", *SMALL, "--failed-per-domain", "3=1", "--policies", "ntp", "--format", "json"])
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


def test_plan_table_lists_each_failed_domain(capsys):
  main(["plan", *SMALL, "--failed-per-domain", "3=1,17=2", "--policies", "ntp"])
  lines = capsys.readouterr().out.splitlines()
  assert lines[-2].split() == ["ntp", "0", "0", "1", "3", "17", "30", "30", "30", "30", "30",
                               "0.9375", "1.0000", "1.0000", "1.0000", "1.0000", "1.0000"]
  # Below the table: the step under each batch policy (capacity from the replicas' shares).
  assert lines[-1].startswith("# ntp: proportional batch: ")
  assert "of the healthy tokens per step in the healthy step time; constant batch: every " \
         "token, step time " in lines[-1]


@pytest.mark.parametrize("value, message", [
    ("0=1,x", "'x' is not DOMAIN=COUNT (COUNT failed GPUs in domain DOMAIN), e.g. 3=1,17=2"),
    ("0:1", "'0:1' is not DOMAIN=COUNT (COUNT failed GPUs in domain DOMAIN), e.g. 3=1,17=2"),
    ("3=-1", "'3=-1' is not DOMAIN=COUNT"),
    ("3=1,3=2", "domain 3 is given twice in '3=1,3=2'"),
])
def test_bad_failed_per_domain_names_the_option(value, message, capsys):
  err = _usage_error(["plan", *SMALL, "--failed-per-domain", value], capsys)
  (line,) = [text for text in err.splitlines() if "error:" in text]
  assert f"error: argument --failed-per-domain: {message}" in line


def test_old_failed_syntax_is_refused(capsys):
  # `--failed 0:1` (domain 0, one GPU) read like train.py's replica:slot pairs.
  err = _usage_error(["plan", *SMALL, "--failed", "0:1"], capsys)
  assert "argument --failed-per-domain: '0:1' is not DOMAIN=COUNT" in err


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
    (["plan", *SMALL, "--failed-per-domain", "999=1"],
     "--failed-per-domain: domain 999 is outside [0, 64)"),
    (["plan", *SMALL, "--failed-per-domain", "3=33"],
     "--failed-per-domain: 33 failed GPUs in domain 3, which has only 32 (--tp)"),
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
  assert lines[-2].split() == ["dp-drop", "-", "-", "0.0000"]
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


def _help_entries(command: str, capsys) -> tuple[set[str], dict[str, str]]:
  """Options in the usage of ``command --help``, and each listed option's help text."""
  with pytest.raises(SystemExit):
    main([command, "--help"])
  out = capsys.readouterr().out
  usage = out.split("\n\n")[0]
  entries, option = {}, None
  for line in out.splitlines():
    if line.startswith("  -"):
      option, _, rest = line.strip().partition("  ")
      option = option.split()[0].rstrip(",")
      entries[option] = rest.strip()
    elif option and line.startswith("   "):
      entries[option] += " " + line.strip()
    else:
      option = None
  return set(re.findall(r"--[a-z-]+", usage)), entries


@pytest.mark.parametrize("command", ["sweep", "timeline", "spares", "plan"])
def test_every_option_has_help_and_default(command, capsys):
  options, entries = _help_entries(command, capsys)
  assert len(options) > 10 and set(entries) == options | {"-h"}
  for option in options:
    help_text = entries[option]
    assert help_text and not help_text.startswith("("), option
    assert ("(default: " in help_text) != (option == "--failed-per-domain"), option
  assert "(default: dp-drop,ntp,ntp-pw)" in entries["--policies"]
  assert entries["--gpus"] == "GPUs of the healthy job (default: 32768)"
  assert entries["--no-pack"].endswith("(default: off)")
  if command == "plan":
    assert entries["--failed-per-domain"].endswith("(required)")


def test_tables_print_each_kind_of_number_one_way(capsys):
  main(["sweep", *SMALL, "--samples", "50", "--fractions", "0.004"])
  header, _, _, *rows = capsys.readouterr().out.splitlines()
  assert header.startswith("# loss sweep: 2,048 GPUs, TP32, 4 domains/replica, blast 1, "
                           "boost +30.00% TDP, seed 0, 50 placements")
  assert rows[0].split() == ["0.0039", "8", "dp-drop", "12.50", "12.50", "12.50"]
  main(["timeline", *SMALL, "--days", "2", "--policies", "ntp"])
  header, _, _, row = capsys.readouterr().out.splitlines()
  assert header.endswith(", 2.00 days, threshold 0.0010")
  assert all(re.fullmatch(r"\d\.\d{4}", v) for v in row.split()[1:])


def test_simulator_does_not_import_jax():
  code = ("import sys, ntp_jax.sim, ntp_jax.sim.cli, ntp_jax.sim.plots; "
          "print('jax' in sys.modules)")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
  assert result.stdout.strip() == "False"
