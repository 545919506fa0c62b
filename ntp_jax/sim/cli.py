"""Command line: ``python -m ntp_jax.sim {sweep,timeline,spares,plan} ...``."""

from __future__ import annotations

import argparse
import pathlib
import re
import textwrap
from collections.abc import Sequence

import numpy as np

from ntp_jax.sim import plots, report
from ntp_jax.sim.batch_policy import BATCH_POLICIES, step_shape
from ntp_jax.sim.cluster import ClusterSpec
from ntp_jax.sim.degrees import DegreeRule
from ntp_jax.sim.failures import LLAMA3_FAILURES_PER_GPU_HOUR, FailureModel
from ntp_jax.sim.planner import plan_replicas
from ntp_jax.sim.policies import ALL_POLICIES, Policy, PolicySettings
from ntp_jax.sim.power import PowerCurve
from ntp_jax.sim.spares import spares_needed
from ntp_jax.sim.sweep import loss_sweep
from ntp_jax.sim.timeline import availability_timeline

_POLICY_NAMES = ", ".join(p.value for p in Policy)
_FAILED_EXAMPLE = "3=1,17=2"


class _HelpFormatter(argparse.HelpFormatter):
  """Appends each option's default to its help, unless the help states it."""

  def _get_help_string(self, action: argparse.Action) -> str:
    help_text = action.help or ""
    if action.required:
      return f"{help_text} (required)"
    if ("(default" in help_text or not action.option_strings
        or action.default is argparse.SUPPRESS):
      return help_text
    if action.nargs == 0:  # a flag
      return f"{help_text} (default: {'on' if action.default else 'off'})"
    return help_text + " (default: %(default)s)"

  def _split_lines(self, text: str, width: int) -> list[str]:
    # As argparse, but without breaking option names such as --max-fraction at hyphens.
    return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _items(text: str) -> list[str]:
  return [v.strip() for v in text.split(",") if v.strip()]


def _comma_list(kind: type, what: str, example: str):
  """argparse type for a comma list of ``kind`` values, e.g. ``32,30,28``."""
  def parse(text: str) -> tuple:
    try:
      return tuple(kind(v) for v in _items(text))
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"{text!r} is not a comma list of {what}, e.g. {example}") from None
  return parse


_int_list = _comma_list(int, "integers", "32,30,28")
_float_list = _comma_list(float, "numbers", "0,0.001,0.002")


def _policy(name: str) -> Policy:
  try:
    return Policy(name)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"{name!r} is not a policy; choose from {_POLICY_NAMES}") from None


def _policy_list(text: str) -> tuple[Policy, ...]:
  """Comma list of policy names, e.g. ``ntp,ntp-pw``."""
  policies = tuple(_policy(v) for v in _items(text))
  if not policies:
    raise argparse.ArgumentTypeError(f"give at least one policy of {_POLICY_NAMES}")
  return policies


_FAILED_ITEM = re.compile(r"\s*(\d+)\s*=\s*(\d+)\s*", re.ASCII)


def _failed_per_domain(text: str) -> dict[int, int]:
  """``DOMAIN=COUNT,...`` (COUNT failed GPUs in scale-up domain DOMAIN) to a dict."""
  failed = {}
  for item in _items(text):
    match = _FAILED_ITEM.fullmatch(item)
    if match is None:
      raise argparse.ArgumentTypeError(
          f"{item!r} is not DOMAIN=COUNT (COUNT failed GPUs in domain DOMAIN), "
          f"e.g. {_FAILED_EXAMPLE}")
    domain, count = map(int, match.groups())
    if domain in failed:
      raise argparse.ArgumentTypeError(f"domain {domain} is given twice in {text!r}")
    failed[domain] = count
  return failed


def _common_parser() -> argparse.ArgumentParser:
  """Options every sub-command takes: cluster, policies, output."""
  parser = argparse.ArgumentParser(add_help=False)
  group = parser.add_argument_group("cluster")
  group.add_argument("--gpus", type=int, default=32_768, help="GPUs of the healthy job")
  group.add_argument("--tp", type=int, default=32, help="scale-up domain size = healthy TP degree")
  group.add_argument("--pp", type=int, default=8, help="domains (pipeline stages) per replica")
  group.add_argument("--blast-radius", type=int, default=1, help="GPUs lost per failure")
  group = parser.add_argument_group("policies")
  # A string default goes through `type`, and --help shows it as typed.
  group.add_argument("--policies", type=_policy_list,
                     default=",".join(p.value for p in ALL_POLICIES),
                     help=f"comma list of {_POLICY_NAMES}")
  group.add_argument("--power-limit", type=float, default=0.3,
                     help="extra power of boosted GPUs, fraction of TDP (NTP-PW)")
  group.add_argument("--efficiency-slope", type=float, default=PowerCurve.slope,
                     help="perf-per-power curve: linear efficiency loss")
  group.add_argument("--efficiency-curvature", type=float, default=PowerCurve.curvature,
                     help="perf-per-power curve: quadratic efficiency loss")
  group.add_argument("--degrees", type=_int_list, default=None,
                     help="allowed reduced TP degrees, e.g. 32,30,28 (default: any)")
  group.add_argument("--local-batch", type=int, default=None,
                     help="samples per healthy replica; shares round down to whole samples "
                          "(default: shares are not rounded)")
  group.add_argument("--no-pack", action="store_true",
                     help="fixed placement instead of packing failed domains together")
  group = parser.add_argument_group("output")
  group.add_argument("--seed", type=int, default=0, help="seed of every random draw")
  group.add_argument("--format", choices=report.FORMATS, default="table",
                     help="what stdout gets")
  group.add_argument("--out", type=pathlib.Path, default=None,
                     help="directory for CSV, JSON and PNG files (default: none, stdout only)")
  return parser


def _failure_parser() -> argparse.ArgumentParser:
  """Options of the failure timeline (defaults from the Llama 3 report)."""
  parser = argparse.ArgumentParser(add_help=False)
  group = parser.add_argument_group("failure model")
  group.add_argument("--rate", type=float, default=LLAMA3_FAILURES_PER_GPU_HOUR,
                     help="failures per GPU-hour (default: %(default).3g, Llama 3)")
  group.add_argument("--rate-scale", type=float, default=1.0, help="multiplies --rate")
  group.add_argument("--hardware-share", type=float, default=0.78,
                     help="fraction of failures that are hardware faults")
  group.add_argument("--hardware-repair-days", type=float, default=5.0,
                     help="repair time of a hardware fault, days")
  group.add_argument("--software-repair-hours", type=float, default=3.0,
                     help="repair time of a software fault, hours")
  group.add_argument("--repair-distribution", choices=("fixed", "exponential"), default="fixed",
                     help="repair times: fixed, or exponential with those means")
  group.add_argument("--days", type=float, default=15.0, help="length of the timeline, days")
  group.add_argument("--step-hours", type=float, default=1.0, help="time step, hours")
  return parser


def build_parser() -> argparse.ArgumentParser:
  """The full argument parser."""
  common, failure = _common_parser(), _failure_parser()
  parser = argparse.ArgumentParser(
      prog="python -m ntp_jax.sim", formatter_class=_HelpFormatter,
      description="Cluster-scale goodput of NTP, NTP-PW and DP-DROP under GPU failures.",
      epilog="Options of a command: python -m ntp_jax.sim COMMAND --help.")
  sub = parser.add_subparsers(dest="command", required=True)

  def add_command(name: str, parents: list, help_text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, parents=parents, help=help_text, description=help_text,
                          formatter_class=_HelpFormatter)

  sweep = add_command("sweep", [common], "loss against the failed fraction")
  sweep.add_argument("--fractions", type=_float_list, default=None,
                     help="comma list of failed fractions (default: --points up to --max-fraction)")
  sweep.add_argument("--max-fraction", type=float, default=4e-3,
                     help="largest failed fraction without --fractions (default: %(default)s)")
  sweep.add_argument("--points", type=int, default=9,
                     help="evenly spaced fractions from 0 to --max-fraction (default: %(default)s)")
  sweep.add_argument("--samples", type=int, default=1000, help="placements per fraction")
  sweep.add_argument("--spares", type=int, default=0, help="spare domains")
  timeline = add_command("timeline", [common, failure], "availability over a failure timeline")
  timeline.add_argument("--spares", type=int, default=0, help="spare domains")
  timeline.add_argument("--threshold", type=float, default=1e-3,
                        help="report the share of time with more than this fraction failed")
  spares = add_command("spares", [common, failure],
                       "spare domains needed to keep a fixed mini-batch running")
  spares.add_argument("--max-spares", type=int, default=160,
                      help="most spare domains tried; spares_needed is - when even these "
                           "do not keep the job running (default: %(default)s)")
  plan = add_command("plan", [common], "per-replica decisions for given failures")
  plan.add_argument("--failed-per-domain", required=True, type=_failed_per_domain,
                    metavar="DOMAIN=COUNT,...",
                    help=f"failed GPUs per scale-up domain: {_FAILED_EXAMPLE} means 1 failed GPU "
                         "in domain 3 and 2 in domain 17 (domains are numbered from 0 to "
                         "gpus/tp - 1; these are not train.py's replica:slot pairs)")
  plan.add_argument("--all", action="store_true", help="list healthy replicas too")
  for command in sub.choices.values():
    command.set_defaults(command_parser=command)
  return parser


def _settings(args) -> PolicySettings:
  rule = DegreeRule(allowed_degrees=args.degrees, local_batch=args.local_batch)
  curve = PowerCurve(slope=args.efficiency_slope, curvature=args.efficiency_curvature)
  return PolicySettings(power_limit=args.power_limit, power_curve=curve, degree_rule=rule,
                        pack=not args.no_pack)


def _failure_model(args) -> FailureModel:
  return FailureModel(rate_per_gpu_hour=args.rate * args.rate_scale,
                      hardware_share=args.hardware_share,
                      hardware_repair_hours=24.0 * args.hardware_repair_days,
                      software_repair_hours=args.software_repair_hours,
                      repair_distribution=args.repair_distribution)


def _title(spec: ClusterSpec, args) -> str:
  title = (f"{report.count(spec.num_gpus)} GPUs, TP{spec.tp}, "
           f"{report.count(spec.pp)} domains/replica, blast {report.count(spec.blast_radius)}, "
           f"boost +{report.percent(100 * args.power_limit)}% TDP, seed {args.seed}")
  if args.degrees:
    title += ", degrees " + "/".join(map(str, args.degrees))
  if args.local_batch:
    title += f", local batch {report.count(args.local_batch)}"
  if args.no_pack:
    title += ", no packing"
  return title


def _emit(rows, columns, args, header: str | None = None, footer: str | None = None) -> None:
  if header and args.format == "table":
    print(header)
  print(report.render(rows, columns, args.format))
  if footer and args.format == "table":
    print(footer)


def _run_sweep(spec: ClusterSpec, args) -> None:
  fractions = args.fractions
  if fractions is None:
    fractions = tuple(np.linspace(0.0, args.max_fraction, args.points))
  points = loss_sweep(spec, fractions, _settings(args), args.policies, args.samples, args.seed,
                      args.spares)
  rows = [{"fraction": p.fraction, "failed_gpus": p.failed_gpus, "policy": p.policy,
           "mean_loss_pct": 100 * p.mean_loss, "max_loss_pct": 100 * p.max_loss,
           "min_loss_pct": 100 * p.min_loss} for p in points]
  columns = {"fraction": report.ratio, "failed_gpus": report.count, "policy": report.text,
             "mean_loss_pct": report.percent, "max_loss_pct": report.percent,
             "min_loss_pct": report.percent}
  _emit(rows, columns, args,
        f"# loss sweep: {_title(spec, args)}, {report.count(args.samples)} placements")
  if args.out:
    report.write_rows(args.out, "loss_sweep", rows, columns)
    plots.plot_loss_sweep(points, args.out / "loss_sweep.png", _title(spec, args))


def _run_timeline(spec: ClusterSpec, args) -> None:
  result = availability_timeline(spec, _failure_model(args), _settings(args), args.days,
                                 args.step_hours, args.seed, args.policies, args.spares)
  rows = result.summary()
  above = result.fraction_of_time_above(args.threshold)
  for row in rows:
    row["mean_failed_fraction"] = float(result.failed_fraction.mean())
    row["max_failed_fraction"] = float(result.failed_fraction.max())
    row["time_above_threshold"] = above
  columns = {"policy": report.text, "mean_availability": report.ratio,
             "min_availability": report.ratio, "mean_failed_fraction": report.ratio,
             "max_failed_fraction": report.ratio, "time_above_threshold": report.ratio}
  _emit(rows, columns, args, f"# availability timeline: {_title(spec, args)}, "
        f"{report.days(args.days)}, threshold {report.ratio(args.threshold)}")
  if args.out:
    series = [{"hours": float(h), "failed_fraction": float(f),
               **{name: float(v[i]) for name, v in result.availability.items()}}
              for i, (h, f) in enumerate(zip(result.hours, result.failed_fraction))]
    report.write_rows(args.out, "timeline", series,
                      ["hours", "failed_fraction", *result.availability])
    report.write_rows(args.out, "timeline_summary", rows, columns)
    plots.plot_timeline(result, args.out / "timeline.png", _title(spec, args))


def _run_spares(spec: ClusterSpec, args) -> None:
  result = spares_needed(spec, _failure_model(args), _settings(args), args.max_spares, args.days,
                         args.step_hours, args.seed, args.policies)
  rows = []
  for policy, needed in result.needed.items():
    rows.append({"policy": policy, "spares_needed": needed,
                 "per_gpu_throughput": (None if needed is None
                                        else float(result.per_gpu_throughput[policy][needed])),
                 "running_with_no_spares": float(result.running_fraction[policy][0])})
  columns = {"policy": report.text, "spares_needed": report.count,
             "per_gpu_throughput": report.ratio, "running_with_no_spares": report.ratio}
  footer = None
  if None in result.needed.values():
    footer = (f"# -: the job still pauses with --max-spares {report.count(args.max_spares)} "
              "spares; raise --max-spares to try more")
  _emit(rows, columns, args, f"# spares for a fixed mini-batch: {_title(spec, args)}, "
        f"{report.days(args.days)}, up to {report.count(args.max_spares)} spares", footer)
  if args.out:
    curve = [{"spares": int(s),
              **{f"{name}_running": float(result.running_fraction[name][i])
                 for name in result.needed},
              **{f"{name}_per_gpu": float(result.per_gpu_throughput[name][i])
                 for name in result.needed}}
             for i, s in enumerate(result.spares)]
    report.write_rows(args.out, "spares_curve", curve, list(curve[0]))
    report.write_rows(args.out, "spares_summary", rows, columns)
    plots.plot_spares(result, args.out / "spares.png", _title(spec, args))


def _run_plan(spec: ClusterSpec, args) -> None:
  for domain, count in args.failed_per_domain.items():
    if domain >= spec.num_domains:
      raise ValueError(f"--failed-per-domain: domain {domain} is outside [0, {spec.num_domains})")
    if count > spec.tp:
      raise ValueError(f"--failed-per-domain: {count} failed GPUs in domain {domain}, "
                       f"which has only {spec.tp} (--tp)")
  settings = _settings(args)
  rows = []
  footer = []
  for policy in args.policies:
    plans = plan_replicas(args.failed_per_domain, spec.tp, spec.pp, args.power_limit, policy,
                          spec.num_domains, settings.power_curve, settings.degree_rule,
                          settings.pack)
    capacity = sum(p.batch_share for p in plans)
    shapes = {b: step_shape(capacity, spec.num_replicas, b) for b in BATCH_POLICIES}
    footer.append(
        f"# {Policy(policy).value}: proportional batch: {float(shapes['proportional'][0]):.4f} "
        f"of the healthy tokens per step in the healthy step time; constant batch: every "
        f"token, step time {float(shapes['constant'][1]):.4f}x")
    for p in plans:
      if p.degraded or args.all:
        rows.append({"policy": Policy(policy).value, "replica": p.replica,
                     "domains": " ".join(map(str, p.domains)),
                     "stage_degrees": " ".join(map(str, p.stage_degrees)), "degree": p.degree,
                     "batch_share": p.batch_share,
                     "stage_boosts": " ".join(map(report.ratio, p.stage_boosts)),
                     "boost": p.boost})
  columns = {"policy": report.text, "replica": report.text, "domains": report.text,
             "stage_degrees": report.text, "degree": report.text, "batch_share": report.ratio,
             "stage_boosts": report.text, "boost": report.ratio}
  _emit(rows, columns, args, f"# replica plan: {_title(spec, args)}", "\n".join(footer))
  if args.out:
    report.write_rows(args.out, "plan", rows, columns)


_COMMANDS = {"sweep": _run_sweep, "timeline": _run_timeline, "spares": _run_spares,
             "plan": _run_plan}


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit status."""
  args, unknown = build_parser().parse_known_args(argv)
  if unknown:
    args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
  try:
    spec = ClusterSpec(num_gpus=args.gpus, tp=args.tp, pp=args.pp,
                       blast_radius=args.blast_radius)
    _COMMANDS[args.command](spec, args)
  except ValueError as error:
    args.command_parser.error(str(error))
  return 0
