"""The training loop: config -> plan -> per-class programs -> steps -> metrics.

``train.py`` only parses flags and calls ``train(config)``. One program is
compiled per replica class (see ``ntp_jax.parallel.plan``); each runs over its own
sub-mesh of the job's devices.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import numpy as np

from ntp_jax.data import make_dataset
from ntp_jax.errors import ConfigError
from ntp_jax.parallel.distributed import check_domains, join, ordered_devices
from ntp_jax.parallel.plan import Plan, make_plan, parse_failed
from ntp_jax.parallel.sync import sync_traffic
from ntp_jax.resilience.events import Event, check_events, failed_text, parse_events
from ntp_jax.resilience.goodput import plot_run
from ntp_jax.resilience.signals import StopSignals
from ntp_jax.sharding.shard import replica_view
from ntp_jax.state.checkpoint import Checkpoints
from ntp_jax.train.footprint import (
  ClassFootprint,
  abstract_program,
  class_footprints,
  device_bytes,
  footprint_table,
  per_device_flops,
  resident_fraction,
  shortfall,
)
from ntp_jax.train.loop import TrainingRun
from ntp_jax.train.metrics import MetricsWriter, TensorBoardWriter
from ntp_jax.train.model_spec import ModelSpec, load_model_spec
from ntp_jax.train.optim import make_optimizer
from ntp_jax.train.report import parameter_table


def _quiet(log):
  """A logger for processes other than 0: only lines marked ``always``."""
  def quiet(line: str, always: bool = False) -> None:
    if always:
      log(line)
  return quiet


def _logger(log):
  """``log`` accepting the ``always`` keyword (process 0 prints every line)."""
  def logger(line: str, always: bool = False) -> None:
    log(line)
  return logger


def plan_from_config(config, model: ModelSpec) -> Plan:
  """The job's plan from ``mesh.*``, ``ntp.*`` and ``train.batch_size``."""
  return make_plan_from(config, model, config.ntp.failed)


def check_devices(plan: Plan, processes_per_domain: int = 1) -> list[jax.Device]:
  """The job's devices: ``mesh.dp * mesh.tp`` of them, slot-major per replica.

  Ordered by process (``distributed.ordered_devices``); in a multi-process
  job every TP group must lie inside one scale-up domain.

  Raises:
    ConfigError: fewer devices than the nominal mesh needs, or a TP group
      across domains.
  """
  devices = ordered_devices()
  needed = plan.dp * plan.tp
  if len(devices) < needed:
    raise ConfigError(f"mesh: mesh.dp x mesh.tp = {needed} devices needed, "
                      f"{len(devices)} present ({devices[0].platform}, "
                      f"{jax.process_count()} process(es))")
  if jax.process_count() > 1:
    check_domains(devices[:needed], plan.tp, plan.dp, processes_per_domain)
  return devices[:needed]


def check_train_fields(train_cfg) -> None:
  """Cheap checks of ``train.*`` before any data or compilation work.

  Raises:
    ConfigError: a count that must be positive is not.
  """
  for name in ("steps", "batch_size", "seq_len", "log_every"):
    if train_cfg[name] < 1:
      raise ConfigError(f"train.{name}: must be >= 1, got {train_cfg[name]}")
  if train_cfg.get("eval_every", 0) < 0:
    raise ConfigError(f"train.eval_every: must be >= 0 (0 = off), got {train_cfg.eval_every}")
  if train_cfg.get("eval_every", 0) and train_cfg.get("eval_sequences", 1) < 1:
    raise ConfigError(f"train.eval_sequences: must be >= 1, got {train_cfg.eval_sequences}")


def check_checkpoint_fields(config) -> None:
  """Raises ConfigError naming ``checkpoint.every`` or ``checkpoint.keep`` when negative."""
  if config.checkpoint.every < 0:
    raise ConfigError(f"checkpoint.every: must be >= 0 (0 = off), got {config.checkpoint.every}")
  if config.checkpoint.keep < 1:
    raise ConfigError(f"checkpoint.keep: must be >= 1, got {config.checkpoint.keep}")


def checkpoint_dir(config) -> str:
  """``checkpoint.dir``, or ``WORKDIR/checkpoints`` when empty."""
  return config.checkpoint.dir or os.path.join(config.workdir, "checkpoints")


def check_same_data(config, meta: dict, where: str, log) -> None:
  """The checkpoint's data position must mean the same sequences in this run.

  Raises:
    ConfigError: naming ``train.seq_len`` when it differs from the checkpoint's
      (the cursor counts sequences of that length). Another seed, data path,
      byte budget or vocabulary gets a one-line warning: the order changes.
  """
  written = meta.get("config", {})
  old = written.get("train", {}).get("seq_len")
  if old is not None and old != config.train.seq_len:
    raise ConfigError(f"train.seq_len: the checkpoint {where} was written with train.seq_len="
                      f"{old}; its data position counts sequences of that length (now "
                      f"{config.train.seq_len}); resume with {old} or set "
                      "checkpoint.resume=False")
  for section, field in (("train", "seed"), ("data", "path"), ("data", "max_corpus_bytes"),
                         ("data", "val_fraction"), ("model", "vocab_size")):
    before = written.get(section, {}).get(field)
    if before is not None and before != config[section].get(field):
      log(f"warning: {section}.{field} was {before!r} when {where} was written, now "
          f"{config[section][field]!r}: the data order differs from the first run")


def describe_written_plan(summary: dict) -> str:
  """One line for the plan a checkpoint was written under (``Plan.summary``)."""
  replicas = "; ".join(f"replica {r['replica']}: TP degree {len(r['live_slots'])}, slots "
                       f"{','.join(map(str, r['live_slots']))}" for r in summary["replicas"])
  return (f"mesh.dp={summary['dp']} x mesh.tp={summary['tp']} ({replicas}), "
          f"{summary['global_batch']} sequences per step")


RECOVERY = ("live", "restart")


def events_from_config(config, plan: Plan) -> tuple[list[Event], set[tuple[int, int]]]:
  """``ntp.fail_at`` and ``ntp.repair_at`` as events, and the launch failures.

  Raises:
    ConfigError: naming the field, for unparsable events, events on slots
      already dead (or repairs of live ones), ``ntp.recovery`` unknown, or a
      recovery that has nothing to recover from.
  """
  recovery = config.ntp.recovery
  if recovery not in RECOVERY:
    raise ConfigError(f"ntp.recovery: {recovery!r} is not one of {', '.join(RECOVERY)}")
  kw = dict(dp=plan.dp, tp=plan.tp, steps=config.train.steps)
  events = (parse_events(config.ntp.fail_at, "fail", **kw)
            + parse_events(config.ntp.repair_at, "repair", **kw))
  failed = {(r, s) for r, slots in parse_failed(config.ntp.failed, plan.dp, plan.tp).items()
            for s in slots}
  check_events(events, failed, plan.tp, plan.dp)
  fails = [e for e in events if e.kind == "fail"]
  if fails and not config.checkpoint.every:
    if recovery == "restart":
      raise ConfigError("ntp.recovery: 'restart' restores the last checkpoint, but "
                        "checkpoint.every=0 writes none")
    if plan.dp == 1:
      raise ConfigError("ntp.fail_at: with mesh.dp=1 no DP peer holds a copy of the state and "
                        "checkpoint.every=0 writes no checkpoint to fall back to")
  return events, failed


def train(config, *, model: ModelSpec | None = None, log=print,
          detector=None) -> dict[str, Any]:
  """Train the model of ``config`` and return a summary.

  The model is ``model``, or the ``ModelSpec`` that ``model.factory`` names
  (default the GPT of ``models.gpt``); see ``ntp_jax.train.model_spec``. A run
  with no checkpoint to resume starts from ``model.initial_source`` when
  set (``model.init_from="hf:FOLDER"``: a Hugging Face folder's weights),
  and the text is encoded with ``model.tokenizer_file`` when set.

  Appends to ``<workdir>/metrics.jsonl`` (one JSON object per step: ``step``,
  ``loss``, ``tokens``, ``step_time_s``, ``tp_degree`` (the smallest live TP
  degree), ``tp_degrees`` (one per live replica), ``grad_norm``,
  ``global_batch``, ``data_cursor`` (sequences consumed after the step),
  ``goodput``, ``effective_tokens_per_s``, and ``checkpoint_s`` on steps
  that start a checkpoint; event rows mark each start, resume, failure,
  repair and stop) and logs a progress line every ``train.log_every`` steps.

  With ``checkpoint.every > 0`` it writes a checkpoint every that many steps,
  at the end, and when SIGTERM or SIGINT arrives (then it stops after the
  step in flight and returns with ``interrupted`` set); with
  ``checkpoint.resume`` it continues from the latest checkpoint in
  ``checkpoint.dir``, onto this config's plan. ``ntp.fail_at`` /
  ``ntp.repair_at`` events (and ``detector``, a ``step -> [events.Event]``
  hook for a real failure detector) change the plan while it runs
  (``ntp_jax.train.loop``).

  In a multi-process job (``distributed.*``, ``python -m ntp_jax.launch``,
  SLURM's ``srun``) every process calls this; ``jax.distributed`` starts
  first (``distributed.join``), each process drives its own devices, and
  process 0 logs and writes the metrics (``docs/multihost.md``).

  Raises:
    ConfigError, DataError: bad settings or input (one line naming the field);
      ``checkpoint.CheckpointError`` (a ``ConfigError``) for an unusable
      checkpoint, naming the path or parameter.
  """
  job = join(config)  # several processes: jax.distributed first, before any computation
  # Process 0 speaks for the job; the others say only where they are.
  log = _logger(log) if job.primary else _quiet(log)
  check_train_fields(config.train)
  check_checkpoint_fields(config)
  model = model or load_model_spec(config)
  optimizer = make_optimizer(config.train)  # validates the optimizer fields up front
  plan = plan_from_config(config, model)
  devices = check_devices(plan, job.processes_per_domain)
  if job.multi_process:
    mine = [i for i, d in enumerate(devices) if d.process_index == job.process_id]
    log(f"process {job.process_id} of {job.num_processes}: {len(jax.local_devices())} local "
        f"devices, replicas {sorted({i // plan.tp for i in mine})}", always=True)
  events, failed = events_from_config(config, plan)
  metrics_path = os.path.join(config.workdir, "metrics.jsonl")
  footprints = check_footprint(config, model, plan, optimizer, devices, log)
  if config.get("dry_run", False):
    return {"losses": [], "plan": plan, "programs": [], "footprints": footprints,
            "dry_run": True, "metrics_path": metrics_path}

  # The data first: a bad data.path stops here, before any checkpoint folder is touched.
  dataset = make_dataset(config.data.path or None, model.vocab_size, config.train.seq_len,
                         config.workdir, config.train.seed,
                         max_corpus_bytes=config.data.max_corpus_bytes,
                         val_fraction=config.data.get("val_fraction", 0.0),
                         tokenizer_path=model.tokenizer_file)
  dataset.check_batch_size(plan.global_batch)

  checkpoints = None
  if config.checkpoint.every:
    checkpoints = Checkpoints(checkpoint_dir(config), keep=config.checkpoint.keep,
                              field="checkpoint.dir" if config.checkpoint.dir else "workdir")
  try:
    start_step, cursor, source, plan, events = _resume_point(
        config, model, checkpoints, plan, events, failed, log)
  except BaseException:
    if checkpoints is not None:  # orbax's threads must stop before the process ends
      checkpoints.close()
    raise
  if start_step is None:
    return {"losses": [], "plan": plan, "programs": [], "start_step": cursor,
            "interrupted": False, "checkpoint": checkpoints.step_dir(cursor),
            "metrics_path": metrics_path}
  log(plan.describe())

  def interrupted_summary():
    return {"losses": [], "plan": plan, "programs": [], "start_step": start_step,
            "interrupted": True, "checkpoint": None, "metrics_path": metrics_path}

  with StopSignals(job.stop_agreement()) as stop:
    try:
      return _run(config, model, optimizer, plan, devices, checkpoints, start_step, cursor,
                  source, stop, log, events, failed, detector, dataset)
    except KeyboardInterrupt:
      where = checkpoints and checkpoints.latest_step()
      saved = (f"last checkpoint {checkpoints.step_dir(where)}" if where is not None
               else "no checkpoint written")
      log(f"interrupted (second Ctrl-C); the step in flight is lost; {saved}")
      return interrupted_summary()
    finally:
      if checkpoints is not None:
        checkpoints.close()


class ResourceError(ConfigError):
  """The devices cannot hold the plan's step (one line saying what it needs)."""


def resident_bytes(plan: Plan, make_model, optimizer, devices) -> list[int]:
  """Per class, bytes one device holds of parameters and optimizer state (shapes only)."""
  programs = [abstract_program(plan, c, make_model, optimizer, 1, devices)[0]
              for c in plan.classes]
  return [device_bytes(p.params) + device_bytes(p.opt_state) for p in programs]


def footprint(config, model: ModelSpec, plan: Plan, optimizer, devices) -> list[ClassFootprint]:
  """Per-device bytes and flops of every class's step (``footprint``), allocating nothing.

  Memory is that of the model as configured (scanned, rematerialised).
  Flops: with ``model.unrolled``, from the unrolled model at 2 and 3 layers,
  extended to ``model.n_layers`` (XLA counts a loop body once); otherwise
  the compiled program's own count.
  """
  args = (optimizer, config.train.clip_norm, config.train.seq_len, devices)
  footprints = class_footprints(plan, model.make, *args, loss=model.loss)
  if model.unrolled is None or model.n_layers is None:
    return footprints

  def flops_at(n_layers):
    small = model.unrolled(n_layers)
    return [f.flops for f in class_footprints(plan, small.make, *args, loss=small.loss)]

  flops = per_device_flops(flops_at, model.n_layers)
  return [dataclasses.replace(f, flops=x) for f, x in zip(footprints, flops)]


def check_footprint(config, model: ModelSpec, plan: Plan, optimizer, devices,
                    log) -> list[ClassFootprint] | None:
  """The memory and compute plan, before anything is allocated.

  With ``dry_run`` it is printed and returned. Otherwise it is worked out
  only when the resident state (parameters and optimizer state, from shapes)
  takes more than a quarter of what the devices hold; then, if the step
  cannot fit, it is printed and the run stops.

  Raises:
    ResourceError: the devices cannot hold the step; the line says what it
      needs and what there is.
  """
  dry_run = config.get("dry_run", False)
  resident = resident_bytes(plan, model.make, optimizer, devices)
  fraction = resident_fraction(plan, resident, devices)
  if not dry_run and (fraction is None or fraction <= 0.25):
    return None
  footprints = footprint(config, model, plan, optimizer, devices)
  tokens = plan.global_batch * config.train.seq_len
  log(plan.describe())
  log(footprint_table(footprints))
  log(f"tokens per step: {tokens:,}; model flops per token "
      f"(6 x parameters): {6 * model.param_count:.3e}")
  problem = shortfall(footprints, devices)
  if dry_run:
    log(f"dry run: {problem or 'the devices can hold this plan'}")
    return footprints
  if problem:
    raise ResourceError(f"{problem} (the plan above; --config.dry_run=True prints it only)")
  return footprints


def _resume_point(config, model, checkpoints, plan, events, failed, log):
  """Where the run starts: ``(step, data cursor, source, plan, events)``.

  From the latest checkpoint when there is one (and ``checkpoint.resume``):
  the plan then also counts the events before that step (``failed`` is
  updated in place). A run that already reached ``train.steps`` returns
  ``(None, that step, ...)`` and its checkpoints are closed.
  """
  start_step, cursor, source = 0, 0, None
  latest = checkpoints.latest_step() if checkpoints and config.checkpoint.resume else None
  if latest is not None:
    meta = checkpoints.meta(latest)
    check_same_data(config, meta, checkpoints.step_dir(latest), log)
    start_step, cursor, source = latest, int(meta["data_cursor"]), checkpoints.source(latest)
    log(f"resuming from step {latest} of {checkpoints.step_dir(latest)}")
    log(f"  written under: {describe_written_plan(meta['plan'])}")
    if start_step >= config.train.steps:
      log(f"step {start_step} already reached train.steps={config.train.steps}; nothing to do")
      checkpoints.close()
      return None, start_step, None, plan, events
    # Events before the resumed step have happened: start from their failed set.
    for e in sorted(e for e in events if e.step < start_step):
      (failed.add if e.kind == "fail" else failed.discard)((e.replica, e.slot))
    events = [e for e in events if e.step >= start_step]
    plan = make_plan_from(config, model, failed_text(failed))
  return start_step, cursor, source, plan, events


def make_plan_from(config, model: ModelSpec, failed: str) -> Plan:
  """The plan of ``config`` with ``failed`` in place of ``ntp.failed``."""
  return make_plan(model.layouts, tp=config.mesh.tp, dp=config.mesh.dp,
                   failed=failed, slot_weights=config.ntp.get("slot_weights", ""),
                   batch_size=config.train.batch_size,
                   rebalance=config.ntp.get("rebalance", "proportional"))


def _run(config, model, optimizer, plan, devices, checkpoints, start_step, cursor, source, stop,
         log, events, failed, detector, dataset) -> dict[str, Any]:
  """Programs and the loop of ``train`` from ``start_step``, data cursor at ``cursor``."""
  log(dataset.describe())
  primary = jax.process_index() == 0  # process 0 writes the metrics, the events, the plot
  writer = MetricsWriter(config.workdir, enabled=primary)
  eval_rows = None
  if config.train.get("eval_every", 0) and dataset.validation is not None:
    count = min(config.train.eval_sequences, dataset.validation.num_sequences)
    eval_rows = dataset.validation.sequences(0, count)  # a fixed set: the same every time
    log(f"validation: mean loss of {count} held-out sequences every "
        f"{config.train.eval_every} steps")
  elif config.train.get("eval_every", 0):
    log("validation: off (data.val_fraction=0 holds out no sequences)")
  board = TensorBoardWriter(os.path.join(config.workdir, "tensorboard")) if config.train.get(
      "tensorboard", False) and primary else None
  run = TrainingRun(config, make_plan=functools.partial(make_plan_from, config, model),
                    make_model=model.make, loss=model.loss,
                    optimizer=optimizer, devices=devices, dataset=dataset,
                    checkpoints=checkpoints, writer=writer, log=log, failed=failed,
                    eval_rows=eval_rows, on_record=board.write if board else None,
                    initial_source=model.initial_source)
  try:
    run.start(plan, source, start_step, cursor)
    # Shapes only: slicing one replica's copy out of the stacked arrays would copy them.
    shapes = [jax.eval_shape(replica_view, p.params) for p in run.programs]
    for program, shape in zip(run.programs, shapes):
      log(f"class {program.replica_class.index} (TP degree {program.replica_class.degree}, "
          f"replicas {list(program.replica_class.replicas)}):")
      log(parameter_table(shape))
    if len(run.programs) > 1:
      itemsize = max(np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes[0]))
      traffic = sync_traffic(plan, shapes, itemsize)
      log(f"gradient sync per step: {traffic['cross_replica'] / 1e6:.2f} MB across domains, "
          f"{traffic['intra_domain'] / 1e6:.2f} MB inside domains "
          f"(logical gradient {traffic['logical'] / 1e6:.2f} MB)")
    writer.event("resume" if source is not None else "start", step=start_step,
                 data_cursor=cursor, plan=plan.summary())

    run.train(config.train.steps, events, stop, detector)

    if checkpoints is not None and run.saved_step != run.step:
      run.save()
    if checkpoints is not None:
      with run.clock.timed("checkpoint_save"):
        checkpoints.wait()
    where = checkpoints.step_dir(run.saved_step) if run.saved_step is not None else None
    finish(run, config, log)
    if stop.received is not None:
      writer.event("stop", step=run.step, signal=stop.received, checkpoint=where)
      saved = (f"checkpoint written to {where}" if where else
               "no checkpoint written (checkpoint.every=0)")
      log(f"interrupted at step {run.step} ({stop.received}); {saved}")
    else:
      writer.event("end", step=run.step, checkpoint=where)
      if where:
        log(f"checkpoint written to {where}")
  finally:
    writer.close()
    if board is not None:
      board.close()
  return {"losses": run.losses, "plan": run.plan, "programs": run.programs,
          "start_step": start_step, "interrupted": stop.received is not None,
          "checkpoint": where, "metrics_path": writer.path, "goodput": run.clock.buckets(),
          "cache": (run.cache.hits, run.cache.misses), "moved_bytes": run.moved_bytes,
          "redone_steps": run.redone_steps, "records": run.records}


def closing_summary(records: list[dict[str, Any]], wall_s: float, metrics_path: str) -> str:
  """Steps, tokens, wall time, tokens/s after compilation, final losses, where the metrics are."""
  if not records:
    return f"summary: no step run; metrics: {metrics_path}"
  tokens = sum(r["tokens"] for r in records)
  timed = [r for r in records if not r.get("compiled")]
  rate = (f"{sum(r['tokens'] for r in timed) / sum(r['step_time_s'] for r in timed):,.0f} "
          "tokens/s after compilation" if timed else "every step compiled")
  compile_s = sum(r["step_time_s"] for r in records if r.get("compiled"))
  val = [r["val_loss"] for r in records if "val_loss" in r]
  losses = f"final loss {records[-1]['loss']:.4f}" + (
      f", validation loss {val[-1]:.4f}" if val else ", no validation loss")
  return (f"summary: {len(records)} steps ({records[0]['step']}-{records[-1]['step']}), "
          f"{tokens:,} tokens in {wall_s:.1f} s (compiling steps {compile_s:.1f} s); "
          f"{rate}; {losses}\n  metrics: {metrics_path}")


def finish(run: TrainingRun, config, log) -> None:
  """Closing summary: the run's figures, goodput buckets, program cache, the plot."""
  log(closing_summary(run.records, run.clock.wall(), run.writer.path))
  log(run.clock.summary())
  if run.redone_steps:
    log(f"redone: {run.redone_steps} step(s)")
  if run.marks:
    log(f"programs: {run.cache.hits} cache hit(s), {run.cache.misses} compiled")
  if run.records and (run.marks or config.train.get("plot", False)) and jax.process_index() == 0:
    path = os.path.join(config.workdir, "goodput.png")
    plot_run(run.records, run.marks, path)
    log(f"plot: {path}")
