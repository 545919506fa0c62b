"""The trainer: config -> plan -> data -> class programs -> the loop and its hooks.

``train.py`` only parses flags and calls ``train(config)``. ``train`` checks
the config once (``training.config.RunConfig``), plans the job
(``parallel.plan``), checks that the devices can hold the step
(``training.resources``), reads the data, finds where to start
(``training.resume``), and hands over to ``loop.TrainingRun`` with the default
step hooks (``training.hooks``) and any the caller adds.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ntp_jax.data import make_dataset
from ntp_jax.data.corpus import resolve_source
from ntp_jax.data.dataset import TOKENIZER_FILE
from ntp_jax.data.tokenizer import copy_file
from ntp_jax.errors import ConfigError, too_few_devices
from ntp_jax.layers.shard import replica_view
from ntp_jax.model import ModelSpec, load_model_spec
from ntp_jax.parallel.plan import Plan
from ntp_jax.parallel.sync import sync_traffic
from ntp_jax.processes.distributed import Job, check_domains, join, ordered_devices
from ntp_jax.resilience.signals import StopSignals
from ntp_jax.sharding.topology import is_mine
from ntp_jax.state.checkpoint import Checkpoints, restart_hint
from ntp_jax.training.caller_hooks import CallerHook, HookError
from ntp_jax.training.compilation import make_folder, set_up_cache
from ntp_jax.training.config import RunConfig, as_run_config
from ntp_jax.training.footprint import ClassFootprint, check_split_step, failure_overrun
from ntp_jax.training.hooks import (
  CheckpointHook,
  DetectorHook,
  EvalHook,
  GoodputHook,
  Hook,
  MetricsHook,
  ProgressHook,
  StepInfo,
  TensorBoardHook,
  as_hook,
)
from ntp_jax.training.loop import TrainingRun, plan_for
from ntp_jax.training.metrics import MetricsWriter, TensorBoardWriter
from ntp_jax.training.optim import make_optimizer, zero_settings
from ntp_jax.training.process_guard import ProcessStop, end_after_grace
from ntp_jax.training.report import parameter_table
from ntp_jax.training.resources import check_footprint
from ntp_jax.training.resume import (
  ResumePoint,
  check_resumable,
  logical_requests,
  resume_point,
)
from ntp_jax.training.run_plot import gather_series, plot_series, run_title


@dataclasses.dataclass
class TrainResult:
  """What ``train`` returns, whichever way the run ended.

  Attributes:
    losses: the training loss of every step run (float, nats per token).
    records: every step's metrics record (as in ``metrics.jsonl``).
    plan: the plan at the end.
    programs: the class programs at the end (empty when no step ran); their
      ``opt_state`` in the class layout also with a sharded optimizer
      (``train.optimizer_sharding=zero1/zero2``: gathered from the pieces at the end).
    start_step: the step the run started (or resumed) at.
    interrupted: a stop signal ended it early.
    checkpoint: the folder of the last checkpoint written, or None.
    metrics_path: ``WORKDIR/metrics.jsonl``.
    goodput: wall seconds per goodput bucket (``resilience.goodput``).
    cache: (hits, misses) of the program cache.
    moved_bytes: bytes moved between devices by live recoveries.
    redone_steps: steps whose work was thrown away.
    compiled_ahead: (programs, wall seconds) compiled in the background for the plans one
      failure or repair away (``ntp.precompile``).
    footprints: per-class memory and flops, when the plan was worked out
      (``dry_run``, or a plan near the devices' capacity).
    dry_run: the run only printed its plan.
  """

  plan: Plan
  metrics_path: str
  losses: list[float] = dataclasses.field(default_factory=list)
  records: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  programs: list = dataclasses.field(default_factory=list)
  start_step: int = 0
  interrupted: bool = False
  checkpoint: str | None = None
  goodput: dict[str, float] = dataclasses.field(default_factory=dict)
  cache: tuple[int, int] = (0, 0)
  moved_bytes: int = 0
  redone_steps: int = 0
  compiled_ahead: tuple[int, float] = (0, 0.0)
  footprints: list[ClassFootprint] | None = None
  dry_run: bool = False


def _speaker_log(log, job: Job):
  """``log`` for ``job``: the speaking process (``Job.speaker``: the lowest live one) prints
  every line; the others only lines marked ``always``."""
  def logger(line: str, always: bool = False) -> None:
    if always or job.speaker:
      log(line)
  return logger


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
    raise too_few_devices(("mesh.dp", "mesh.tp"), needed, len(devices), devices[0].platform,
                          jax.process_count())
  if jax.process_count() > 1:
    check_domains(devices[:needed], plan.tp, plan.dp, processes_per_domain)
  return devices[:needed]


def train(config, *, model: ModelSpec | None = None, log=print,
          detector: Callable[[int], Sequence[Any]] | None = None,
          hooks: Sequence[Hook | Callable[[StepInfo], Any]] = ()) -> TrainResult:
  """Train the model of ``config`` and return a ``TrainResult``.

  Args:
    config: an ``ml_collections.ConfigDict`` (``configs/*.py``), checked here
      once, or a ``RunConfig`` already checked.
    model: the ``ModelSpec``; default the one ``model.factory`` names (the
      GPT of ``models.gpt``); see ``ntp_jax.model.spec``. A run with
      no checkpoint to resume starts from ``model.initial_source`` when set
      (``model.init_from="hf:FOLDER"``: a Hugging Face folder's weights),
      and the text is encoded with ``model.tokenizer_file`` when set.
    log: one-line logger (process 0's; the others print only where they are).
    detector: ``step -> [events.Event]`` called before each step, a failure
      detector (``hooks.DetectorHook``); it may raise ``events.DeviceFailure``.
    hooks: ``hooks.Hook``s, or functions of ``hooks.StepInfo`` called after
      every step, run after the default hooks (checkpoint, validation,
      goodput, metrics, TensorBoard, progress). An exception in one (or in
      ``detector``) ends the run as a stop does: the steps done are saved
      (``checkpoint.every > 0``, one process), a ``stop`` row names the hook
      (``{"event": "stop", "hook": "Class.method", "error": ...}``), a line
      says where it stopped, and the exception is raised again.

  Appends to ``<workdir>/metrics.jsonl`` (one JSON object per step: ``step``,
  ``loss``, ``tokens``, ``step_time_s``, ``tp_degree`` (the smallest live TP
  degree), ``tp_degrees`` (one per live replica), ``grad_norm``,
  ``global_batch``, ``data_cursor`` (sequences consumed after the step),
  ``goodput``, ``effective_tokens_per_s``, ``checkpoint_s`` on steps that
  start a checkpoint, ``val_loss`` on validation steps, and ``compiled``
  with ``programs_compiled`` and ``programs_loaded`` (from the persistent
  compilation cache) on steps whose programs were new to the process; event rows mark
  each start, resume, failure, repair and stop) and logs a progress line
  every ``train.log_every`` steps.

  With ``checkpoint.every > 0`` it writes a checkpoint every that many steps,
  at the end, and when SIGTERM or SIGINT arrives (then it stops after the
  step in flight and returns with ``interrupted`` set); with
  ``checkpoint.resume`` it continues from the latest checkpoint in
  ``checkpoint.dir``, onto this config's plan. ``ntp.fail_at`` /
  ``ntp.repair_at`` events and ``detector`` change the plan while it runs
  (``ntp_jax.training.loop``).

  In a multi-process job (``distributed.*``, ``python -m ntp_jax.launch``,
  SLURM's ``srun``) every process calls this; ``jax.distributed`` starts
  first (``distributed.join``), each process drives its own devices, and
  process 0 logs and writes the metrics (``docs/multihost.md``).

  Raises:
    Exception: whatever a caller's hook raised, after the run has stopped as above.
    ConfigError, DataError: bad settings or input (one line naming the field);
      ``checkpoint.CheckpointError`` (a ``ConfigError``) for an unusable
      checkpoint, naming the path or parameter; ``resources.ResourceError``
      (a ``ConfigError``) when the devices cannot hold the step;
      ``ConfigError`` when the plan needs the split step and the model is past its
      int32 indexing (``footprint.check_split_step``), at the start or at a failure.
    process_guard.ProcessStop: a peer process was lost and this one must end (its
      ``status`` and one-line ``message``; the last completed step written as a
      just-in-time checkpoint where possible); end the process with ``os._exit(status)``
      (a thread does, ``process_guard.STOP_GRACE_S`` later, if the caller cannot).
  """
  config = as_run_config(config)
  user_hooks = [as_hook(h) for h in hooks]
  job = join(config.distributed)  # several processes: jax.distributed first, before computing
  if job.heartbeat is not None:  # a process that stops says what a restart resumes from
    job.heartbeat.restart_hint = functools.partial(
        restart_hint, config.checkpoint.dir if config.checkpoint.enabled else None)
  # The lowest live process speaks for the job; the others say only where they are.
  log = _speaker_log(log, job)
  model = model or load_model_spec(config.model.factory, config.source)
  optimizer = make_optimizer(config.train)
  plan_of = functools.partial(plan_for, config, model)
  plan = plan_of(config.ntp.failed)
  devices = check_devices(plan, job.processes_per_domain)
  if config.data.path:
    resolve_source(config.data.path)  # a data.path that names nothing: before any folder
  # What can be checked cheaply was: now the run's folders, and the persistent cache before
  # anything compiles (a restart loads what this run compiled).
  make_folder(config.workdir, "workdir")
  set_up_cache(config.compile.cache_dir, config.workdir)
  if config.model.init_from and model.tokenizer_file is None:
    log(f"warning: model.init_from: {config.model.init_from} has no {TOKENIZER_FILE}; a "
        f"{model.vocab_size:,}-token BPE tokenizer is trained on the data instead, whose ids "
        "are not the tokens these weights learned")
  for note in job.notes:
    log(note)
  if job.multi_process:
    mine = [i for i, d in enumerate(devices) if is_mine(d)]
    local = len(jax.local_devices())
    log(f"process {job.process_id} of {job.num_processes}: {local} local "
        f"device{'s' if local != 1 else ''}, replicas {sorted({i // plan.tp for i in mine})}",
        always=True)
  metrics_path = os.path.join(config.workdir, "metrics.jsonl")
  # A model past the split step's int32 indexing (from shapes): refused before the memory
  # plan compiles anything if its plan needs that step (a dry run says so after its tables),
  # else told that a failed slot would stop it, not met by a traceback when one comes.
  zero = zero_settings(config.train)
  if len(plan.classes) > 1 or zero is not None:
    try:
      check_split_step(plan, model, zero is not None)
      unbuildable = None
    except ConfigError as err:
      if not config.dry_run:
        raise
      unbuildable = f"this plan cannot be built: {err}"
  else:
    unbuildable = failure_overrun(plan, config.ntp.failed, plan_of, model, sharded=False)
  if unbuildable is not None and not config.dry_run:  # before the memory plan, which may stop it
    log(f"warning: {unbuildable}")
  footprints = check_footprint(config, model, plan, optimizer, devices, log)
  if unbuildable is not None and config.dry_run:  # after its tables
    log(f"warning: {unbuildable}")
  if config.dry_run:
    return TrainResult(plan=plan, metrics_path=metrics_path, footprints=footprints,
                       dry_run=True)

  checkpoints = None
  try:
    # A checkpoint this run cannot resume (or a fresh run into another run's checkpoints)
    # stops it before the data (a tokenizer to train can take many seconds); a bad data.path
    # stops before a checkpoint folder is created.
    if config.checkpoint.enabled and os.path.isdir(config.checkpoint.dir):
      checkpoints = open_checkpoints(config)
      check_resumable(config, checkpoints, logical_requests(model, plan, optimizer))
    dataset = make_dataset(config.data.path or None, model.vocab_size, config.train.seq_len,
                           config.workdir, config.train.seed,
                           max_corpus_bytes=config.data.max_corpus_bytes,
                           val_fraction=config.data.val_fraction,
                           tokenizer_path=model.tokenizer_file)
    dataset.check_batch_size(plan.global_batch)
    if config.checkpoint.enabled and checkpoints is None:
      checkpoints = open_checkpoints(config)
    if checkpoints is not None and dataset.tokenizer_path and job.primary:
      # The tokenizer travels with the weights (python -m ntp_jax.interop.export_hf).
      copy_file(dataset.tokenizer_path, os.path.join(config.checkpoint.dir, TOKENIZER_FILE))
    start = resume_point(config, checkpoints, plan, plan_of, log)
  except BaseException:
    if checkpoints is not None:  # orbax's threads must stop before the process ends
      checkpoints.close()
    raise
  if start.done:
    checkpoints.close()
    return TrainResult(plan=start.plan, metrics_path=metrics_path, start_step=start.step,
                       checkpoint=checkpoints.step_dir(start.step))
  log(start.plan.describe())

  extra = [CallerHook(h) for h in
           ([DetectorHook(detector)] if detector is not None else []) + user_hooks]
  lost = False
  with StopSignals(job.stop_agreement()) as stop:
    try:
      return _run(config, model, optimizer, devices, checkpoints, start, stop, log, dataset,
                  extra, job)
    except ProcessStop as process_stop:
      lost = True  # closing would wait for the lost peer in orbax's threads
      end_after_grace(process_stop)  # the caller ends the process; if it cannot, this does
      raise
    except KeyboardInterrupt:
      where = checkpoints and checkpoints.latest_step()
      saved = (f"last checkpoint {checkpoints.step_dir(where)}" if where is not None
               else "no checkpoint written")
      log(f"interrupted (second Ctrl-C); the step in flight is lost; {saved}")
      return TrainResult(plan=start.plan, metrics_path=metrics_path, start_step=start.step,
                         interrupted=True)
    finally:
      if checkpoints is not None and not lost:
        checkpoints.close()


def open_checkpoints(config: RunConfig) -> Checkpoints:
  """The run's checkpoint folder (created if missing)."""
  return Checkpoints(config.checkpoint.dir, keep=config.checkpoint.keep,
                     field=config.checkpoint.dir_field)


def precompile_on(config: RunConfig, devices: Sequence[jax.Device], log) -> bool:
  """``ntp.precompile`` resolved: compile the plans one failure or repair away in the
  background (``ntp_jax.training.precompile``)? ``auto`` is on for GPU and TPU, off on CPU (the
  compiling thread would take the cores the step runs on). Logs the choice."""
  setting = config.ntp.precompile
  on = setting == "next_failure" or (setting == "auto" and devices[0].platform != "cpu")
  if on:
    log("compile ahead: on (ntp.precompile): the plans one failure or repair away compile in "
        "the background")
  return on


def default_hooks(config: RunConfig, run_log, writer: MetricsWriter, dataset,
                  primary: bool) -> list[Hook]:
  """The trainer's own hooks, in order: checkpoint, validation, goodput, metrics file,
  TensorBoard, progress line (``training.hooks``)."""
  hooks: list[Hook] = []
  if config.checkpoint.enabled:
    hooks.append(CheckpointHook(config.checkpoint.every))
  if config.train.eval_every and dataset.validation is not None:
    count = min(config.train.eval_sequences, dataset.validation.num_sequences)
    rows = dataset.validation.sequences(0, count)  # a fixed set: the same every time
    run_log(f"validation: mean loss of {count} held-out sequences every "
            f"{config.train.eval_every} steps")
    hooks.append(EvalHook(rows, config.train.eval_every))
  elif config.train.eval_every:
    run_log("validation: off (data.val_fraction=0 holds out no sequences)")
  hooks += [GoodputHook(), MetricsHook(writer)]
  if config.train.tensorboard and primary:
    hooks.append(TensorBoardHook(TensorBoardWriter(os.path.join(config.workdir,
                                                                "tensorboard"))))
  hooks.append(ProgressHook(run_log, config.train.log_every))
  return hooks


def _run(config: RunConfig, model: ModelSpec, optimizer, devices, checkpoints,
         start: ResumePoint, stop, log, dataset, extra_hooks: list[Hook],
         job: Job | None = None) -> TrainResult:
  """Programs and the loop of ``train`` from ``start``."""
  log(dataset.describe())
  # The speaking process writes the metrics and events (the lowest live one: it changes
  # when that one is lost), and TensorBoard's files (process 0 only).
  primary = jax.process_index() == 0
  writer = MetricsWriter(config.workdir,
                         enabled=lambda: job is None or job.speaker)
  run = TrainingRun(config, model, optimizer=optimizer, devices=devices, dataset=dataset,
                    checkpoints=checkpoints, writer=writer, log=log, failed=start.failed,
                    hooks=default_hooks(config, log, writer, dataset, primary) + extra_hooks,
                    precompile=precompile_on(config, devices, log), job=job,
                    zero=zero_settings(config.train))
  try:
    run.check_event_plans(start.events)  # from shapes: before anything is placed
    run.start(start.plan, start.source, start.step, start.cursor)
    plan, state = start.plan, run.state
    # Shapes only: slicing one replica's copy out of the stacked arrays would copy them.
    shapes = [jax.eval_shape(replica_view, p.params) for p in state.programs]
    for program, shape in zip(state.programs, shapes):
      log(f"class {program.replica_class.index} (TP degree {program.replica_class.degree}, "
          f"replicas {list(program.replica_class.replicas)}):")
      log(parameter_table(shape))
    if len(state.programs) > 1:
      itemsize = max(np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes[0]))
      traffic = sync_traffic(plan, shapes, itemsize)
      log(f"gradient sync per step: {traffic['cross_replica'] / 1e6:.2f} MB across domains, "
          f"{traffic['intra_domain'] / 1e6:.2f} MB inside domains "
          f"(logical gradient {traffic['logical'] / 1e6:.2f} MB)")
    writer.event("resume" if start.source is not None else "start", step=start.step,
                 data_cursor=start.cursor, plan=plan.summary(),
                 optimizer_sharding=config.train.optimizer_sharding,
                 optimizer_copies=config.train.optimizer_copies)

    hook_error = None
    try:
      run.train(config.train.steps, start.events, stop)
    except HookError as err:
      hook_error = err  # the run ends as a stopped one does, then the hook's error is raised
    # A save is collective over the processes: one whose hook raised cannot make it alone
    # (the others meet its loss and write the last completed step themselves).
    if (checkpoints is not None and state.saved_step != state.step
        and (hook_error is None or jax.process_count() == 1)):
      run.save()
    if checkpoints is not None:
      with run.clock.timed("checkpoint_save"):
        checkpoints.wait()
    where = checkpoints.step_dir(state.saved_step) if state.saved_step is not None else None
    finish(run, config, log)
    saved = (f"checkpoint written to {where}" if where else
             "no checkpoint written (checkpoint.every=0)")
    if hook_error is not None:
      writer.event("stop", step=state.step, hook=hook_error.where,
                   error=f"{type(hook_error.error).__name__}: {hook_error.error}",
                   checkpoint=where)
      plot(run, config, log)
      log(f"stopped after {state.step} steps: {hook_error}; {saved}")
      raise hook_error.error
    if stop.received is not None:
      writer.event("stop", step=state.step, signal=stop.received, checkpoint=where)
      plot(run, config, log)  # after the stop's row; the line saying where it stopped is last
      log(f"interrupted at step {state.step} ({stop.received}); {saved}")
    else:
      writer.event("end", step=state.step, checkpoint=where)
      if where:
        log(f"checkpoint written to {where}")
      plot(run, config, log)
  finally:
    writer.close()
  ahead = run.precompiler
  programs = state.programs
  if getattr(state, "job_step", None) is not None:  # a sharded state: in the class layout
    programs = state.job_step.class_programs()
  return TrainResult(plan=state.plan, metrics_path=writer.path, losses=run.losses,
                     records=run.records, programs=programs, start_step=start.step,
                     interrupted=stop.received is not None, checkpoint=where,
                     goodput=run.clock.buckets(), cache=(run.cache.hits, run.cache.misses),
                     moved_bytes=run.moved_bytes, redone_steps=run.redone_steps,
                     compiled_ahead=(ahead.compiled, ahead.seconds) if ahead else (0, 0.0))


def closing_summary(records: list[dict[str, Any]], wall_s: float, metrics_path: str,
                    compile_s: float) -> str:
  """Steps, tokens, wall time and the part of it spent compiling (``compile_s``: the goodput
  clock's ``compile`` bucket, so the two lines agree), tokens/s after compilation, final
  losses, where the metrics are."""
  if not records:
    return f"summary: no step run; metrics: {metrics_path}"
  tokens = sum(r["tokens"] for r in records)
  timed = [r for r in records if not r.get("compiled")]
  rate = (f"{sum(r['tokens'] for r in timed) / sum(r['step_time_s'] for r in timed):,.0f} "
          "tokens/s after compilation" if timed else "every step compiled")
  val = [r["val_loss"] for r in records if "val_loss" in r]
  losses = f"final loss {records[-1]['loss']:.4f}" + (
      f", validation loss {val[-1]:.4f}" if val else ", no validation loss")
  return (f"summary: {len(records)} steps ({records[0]['step']}-{records[-1]['step']}), "
          f"{tokens:,} tokens in {wall_s:.1f} s ({compile_s:.1f} s of it compiling); "
          f"{rate}; {losses}\n  metrics: {metrics_path}")


def finish(run: TrainingRun, config: RunConfig, log) -> None:
  """Closing summary: the run's figures, goodput buckets, program cache."""
  log(closing_summary(run.records, run.clock.wall(), run.writer.path,
                      run.clock.buckets()["compile"]))
  log(run.clock.summary())
  if run.redone_steps:
    log(f"redone: {run.redone_steps} step(s)")
  if run.marks:
    # The run's cache of class steps and syncs, by plan: a plan met again reuses them. (The
    # first-step lines count XLA programs, the state moves' included.)
    log(f"class steps and syncs: {run.cache.misses} made for a plan, {run.cache.hits} reused "
        "for a plan met again")


def plot(run: TrainingRun, config: RunConfig, log) -> None:
  """``WORKDIR/goodput.png`` of the whole run, every session of ``metrics.jsonl``
  (``training.run_plot``), with ``train.plot`` (failures and repairs marked); none without."""
  if run.records and config.train.plot and (run.job is None or run.job.speaker):
    path = os.path.join(config.workdir, "goodput.png")
    series = gather_series(run.writer.path)
    plot_series(series, path, run_title(config.workdir, config.source.model, series))
    log(f"plot: {path}")
