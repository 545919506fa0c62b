"""Command line: ``python -m ntp_jax.sim {sweep,timeline,spares,plan} ...``."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence

import numpy as np

from ntp_jax.sim import plots, report
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


def _failed_pair(pair: str) -> tuple[int, int]:
  try:
    domain, count = pair.split(":")
    return int(domain), int(count)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"{pair!r} is not domain:count (failed GPUs in a domain), e.g. 0:1,17:2") from None


def _failed_domains(text: str) -> dict[int, int]:
  """Comma list of ``domain:count`` pairs to failed GPUs per domain (repeats add up)."""
  failed = {}
  for domain, count in map(_failed_pair, _items(text)):
    failed[domain] = failed.get(domain, 0) + count
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
  group.add_argument("--policies", type=_policy_list, default=ALL_POLICIES,
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
                     help="samples per healthy replica; shares round down to whole samples")
  group.add_argument("--no-pack", action="store_true",
                     help="fixed placement instead of packing failed domains together")
  group = parser.add_argument_group("output")
  group.add_argument("--seed", type=int, default=0)
  group.add_argument("--format", choices=report.FORMATS, default="table",
                     help="what stdout gets")
  group.add_argument("--out", type=pathlib.Path, default=None,
                     help="directory for CSV, JSON and PNG files")
  return parser


def _failure_parser() -> argparse.ArgumentParser:
  """Options of the failure timeline (defaults from the Llama 3 report)."""
  parser = argparse.ArgumentParser(add_help=False)
  group = parser.add_argument_group("failure model")
  group.add_argument("--rate", type=float, default=LLAMA3_FAILURES_PER_GPU_HOUR,
                     help="failures per GPU-hour")
  group.add_argument("--rate-scale", type=float, default=1.0, help="multiplies --rate")
  group.add_argument("--hardware-share", type=float, default=0.78)
  group.add_argument("--hardware-repair-days", type=float, default=5.0)
  group.add_argument("--software-repair-hours", type=float, default=3.0)
  group.add_argument("--repair-distribution", choices=("fixed", "exponential"), default="fixed")
  group.add_argument("--days", type=float, default=15.0, help="length of the timeline")
  group.add_argument("--step-hours", type=float, default=1.0, help="time step")
  return parser


def build_parser() -> argparse.ArgumentParser:
  """The full argument parser."""
  common, failure = _common_parser(), _failure_parser()
  parser = argparse.ArgumentParser(
      prog="python -m ntp_jax.sim",
      description="Cluster-scale goodput of NTP, NTP-PW and DP-DROP under GPU failures.")
  sub = parser.add_subparsers(dest="command", required=True)
  sweep = sub.add_parser("sweep", parents=[common], help="loss against the failed fraction")
  sweep.add_argument("--fractions", type=_float_list, default=None,
                     help="comma list of failed fractions (default: --points up to --max-fraction)")
  sweep.add_argument("--max-fraction", type=float, default=4e-3,
                     help="largest failed fraction without --fractions (default: %(default)s)")
  sweep.add_argument("--points", type=int, default=9,
                     help="evenly spaced fractions from 0 to --max-fraction (default: %(default)s)")
  sweep.add_argument("--samples", type=int, default=1000, help="placements per fraction")
  sweep.add_argument("--spares", type=int, default=0, help="spare domains")
  timeline = sub.add_parser("timeline", parents=[common, failure],
                            help="availability over a failure timeline")
  timeline.add_argument("--spares", type=int, default=0, help="spare domains")
  timeline.add_argument("--threshold", type=float, default=1e-3,
                        help="report the share of time with more than this fraction failed")
  spares = sub.add_parser("spares", parents=[common, failure],
                          help="spare domains needed to keep a fixed mini-batch running")
  spares.add_argument("--max-spares", type=int, default=160,
                      help="most spare domains tried; spares_needed is - when even these "
                           "do not keep the job running (default: %(default)s)")
  plan = sub.add_parser("plan", parents=[common], help="per-replica decisions for given failures")
  plan.add_argument("--failed", required=True, type=_failed_domains,
                    help="domain:count pairs, e.g. 0:1,17:2 (failed GPUs per domain)")
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
  title = (f"{spec.num_gpus} GPUs, TP{spec.tp}, {spec.pp} domains/replica, "
           f"blast {spec.blast_radius}, boost +{100 * args.power_limit:.0f}% TDP, seed {args.seed}")
  if args.degrees:
    title += ", degrees " + "/".join(map(str, args.degrees))
  if args.local_batch:
    title += f", local batch {args.local_batch}"
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
  columns = ["fraction", "failed_gpus", "policy", "mean_loss_pct", "max_loss_pct",
             "min_loss_pct"]
  _emit(rows, columns, args, f"# loss sweep: {_title(spec, args)}, {args.samples} placements")
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
  columns = ["policy", "mean_availability", "min_availability", "mean_failed_fraction",
             "max_failed_fraction", "time_above_threshold"]
  _emit(rows, columns, args, f"# availability timeline: {_title(spec, args)}, {args.days} days, "
        f"threshold {args.threshold}")
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
  columns = ["policy", "spares_needed", "per_gpu_throughput", "running_with_no_spares"]
  footer = None
  if None in result.needed.values():
    footer = (f"# -: the job still pauses with --max-spares {args.max_spares} spares; "
              "raise --max-spares to try more")
  _emit(rows, columns, args, f"# spares for a fixed mini-batch: {_title(spec, args)}, "
        f"{args.days} days, up to {args.max_spares} spares", footer)
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
  settings = _settings(args)
  rows = []
  for policy in args.policies:
    plans = plan_replicas(args.failed, spec.tp, spec.pp, args.power_limit, policy,
                          spec.num_domains, settings.power_curve, settings.degree_rule,
                          settings.pack)
    for p in plans:
      if p.degraded or args.all:
        rows.append({"policy": Policy(policy).value, "replica": p.replica,
                     "domains": " ".join(map(str, p.domains)),
                     "stage_degrees": " ".join(map(str, p.stage_degrees)), "degree": p.degree,
                     "batch_share": p.batch_share,
                     "stage_boosts": " ".join(f"{b:.3f}" for b in p.stage_boosts),
                     "boost": p.boost})
  columns = ["policy", "replica", "domains", "stage_degrees", "degree", "batch_share",
             "stage_boosts", "boost"]
  _emit(rows, columns, args, f"# replica plan: {_title(spec, args)}")
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
