"""The training loop: config -> plan -> per-class programs -> steps -> metrics.

``train.py`` only parses flags and calls ``train(config)``. One program is
compiled per replica class (see ``ntp_jax.plan``); each runs over its own
sub-mesh of the job's devices.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from models.gpt import GPT, GPTConfig, model_layouts
from ntp_jax.checkpoint import Checkpoints
from ntp_jax.data import make_dataset
from ntp_jax.errors import ConfigError
from ntp_jax.metrics import MetricsWriter, progress_line
from ntp_jax.optim import make_optimizer
from ntp_jax.plan import Plan, make_plan
from ntp_jax.replica_class import JobStep, build_class_programs, logical_state
from ntp_jax.report import parameter_table
from ntp_jax.signals import StopSignals
from ntp_jax.shard import replica_view
from ntp_jax.sync import sync_traffic


def plan_from_config(config, cfg: GPTConfig) -> Plan:
  """The job's plan from ``mesh.*``, ``ntp.*`` and ``train.batch_size``."""
  return make_plan(functools.partial(model_layouts, cfg), tp=config.mesh.tp, dp=config.mesh.dp,
                   failed=config.ntp.failed, slot_weights=config.ntp.get("slot_weights", ""),
                   batch_size=config.train.batch_size,
                   rebalance=config.ntp.get("rebalance", "proportional"))


def check_devices(plan: Plan) -> list[jax.Device]:
  """The job's devices: ``mesh.dp * mesh.tp`` of them, slot-major per replica.

  Raises:
    ConfigError: fewer devices than the nominal mesh needs.
  """
  devices = jax.devices()
  needed = plan.dp * plan.tp
  if len(devices) < needed:
    raise ConfigError(f"mesh: mesh.dp x mesh.tp = {needed} devices needed, "
                      f"{len(devices)} present ({devices[0].platform})")
  return devices[:needed]


def check_train_fields(train_cfg) -> None:
  """Cheap checks of ``train.*`` before any data or compilation work.

  Raises:
    ConfigError: a count that must be positive is not.
  """
  for name in ("steps", "batch_size", "seq_len", "log_every"):
    if train_cfg[name] < 1:
      raise ConfigError(f"train.{name}: must be >= 1, got {train_cfg[name]}")


def check_checkpoint_fields(config) -> None:
  """Raises ConfigError naming ``checkpoint.every`` or ``checkpoint.keep`` when negative."""
  if config.checkpoint.every < 0:
    raise ConfigError(f"checkpoint.every: must be >= 0 (0 = off), got {config.checkpoint.every}")
  if config.checkpoint.keep < 1:
    raise ConfigError(f"checkpoint.keep: must be >= 1, got {config.checkpoint.keep}")


def checkpoint_dir(config) -> str:
  """``checkpoint.dir``, or ``WORKDIR/checkpoints`` when empty."""
  return config.checkpoint.dir or os.path.join(config.workdir, "checkpoints")


def describe_written_plan(summary: dict) -> str:
  """One line for the plan a checkpoint was written under (``Plan.summary``)."""
  replicas = "; ".join(f"replica {r['replica']}: slots {','.join(map(str, r['live_slots']))}"
                       for r in summary["replicas"])
  return (f"mesh.dp={summary['dp']} x mesh.tp={summary['tp']} ({replicas}), "
          f"{summary['global_batch']} sequences per step")


def train(config, *, log=print) -> dict[str, Any]:
  """Train the model of ``config`` and return a summary.

  Appends to ``<workdir>/metrics.jsonl`` (one JSON object per step: ``step``,
  ``loss``, ``tokens``, ``step_time_s``, ``tp_degree`` (the smallest live TP
  degree), ``tp_degrees`` (one per live replica), ``grad_norm``,
  ``global_batch``, ``data_cursor`` (sequences consumed after the step), and
  ``checkpoint_s`` on steps that start a checkpoint; event rows mark each
  start, resume and stop) and logs a progress line every
  ``train.log_every`` steps.

  With ``checkpoint.every > 0`` it writes a checkpoint every that many steps,
  at the end, and when SIGTERM or SIGINT arrives (then it stops after the
  step in flight and returns with ``interrupted`` set); with
  ``checkpoint.resume`` it continues from the latest checkpoint in
  ``checkpoint.dir``, onto this config's plan.

  Raises:
    ConfigError, DataError: bad settings or input (one line naming the field);
      ``checkpoint.CheckpointError`` (a ``ConfigError``) for an unusable
      checkpoint, naming the path or parameter.
  """
  check_train_fields(config.train)
  check_checkpoint_fields(config)
  cfg = GPTConfig.from_config(config.model)
  optimizer = make_optimizer(config.train)  # validates the optimizer fields up front
  plan = plan_from_config(config, cfg)
  devices = check_devices(plan)

  checkpoints = None
  if config.checkpoint.every:
    checkpoints = Checkpoints(checkpoint_dir(config), keep=config.checkpoint.keep)
  start_step, cursor, source = 0, 0, None
  latest = checkpoints.latest_step() if checkpoints and config.checkpoint.resume else None
  if latest is not None:
    meta = checkpoints.meta(latest)
    start_step, cursor, source = latest, int(meta["data_cursor"]), checkpoints.source(latest)
    log(f"resuming from step {latest} of {checkpoints.step_dir(latest)}")
    log(f"  written under: {describe_written_plan(meta['plan'])}")
    if start_step >= config.train.steps:
      log(f"step {start_step} already reached train.steps={config.train.steps}; nothing to do")
      checkpoints.close()
      return {"losses": [], "plan": plan, "programs": [], "start_step": start_step,
              "interrupted": False, "checkpoint": checkpoints.step_dir(latest),
              "metrics_path": os.path.join(config.workdir, "metrics.jsonl")}
  log(plan.describe())

  with StopSignals() as stop:
    try:
      return _run(config, cfg, optimizer, plan, devices, checkpoints, start_step, cursor,
                  source, stop, log)
    except KeyboardInterrupt:
      where = checkpoints and checkpoints.latest_step()
      saved = (f"last checkpoint {checkpoints.step_dir(where)}" if where is not None
               else "no checkpoint written")
      log(f"interrupted (second Ctrl-C); the step in flight is lost; {saved}")
      return {"losses": [], "plan": plan, "programs": [], "start_step": start_step,
              "interrupted": True, "checkpoint": None,
              "metrics_path": os.path.join(config.workdir, "metrics.jsonl")}
    finally:
      if checkpoints is not None:
        checkpoints.close()


def _run(config, cfg, optimizer, plan, devices, checkpoints, start_step, cursor, source, stop,
         log) -> dict[str, Any]:
  """The loop of ``train`` from ``start_step`` with the data cursor at ``cursor``."""
  seq_len = config.train.seq_len
  dataset = make_dataset(config.data.path or None, cfg.vocab_size, seq_len, config.workdir,
                         config.train.seed, max_corpus_bytes=config.data.max_corpus_bytes)
  dataset.check_batch_size(plan.global_batch)
  log(dataset.describe())

  global_tokens = plan.global_batch * seq_len
  programs = build_class_programs(
      plan, lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(config.train.seed)), optimizer,
      config.train.clip_norm, global_tokens, devices, source=source)
  job_step = JobStep(plan, programs)
  # Shapes only: slicing one replica's copy out of the stacked arrays would copy them.
  shapes = [jax.eval_shape(replica_view, p.params) for p in programs]
  for program, shape in zip(programs, shapes):
    log(f"class {program.replica_class.index} (TP degree {program.replica_class.degree}, "
        f"replicas {list(program.replica_class.replicas)}):")
    log(parameter_table(shape))

  if len(programs) > 1:
    traffic = sync_traffic(plan, shapes,
                           np.dtype(cfg.storage_dtype).itemsize)
    log(f"gradient sync per step: {traffic['cross_replica'] / 1e6:.2f} MB across domains, "
        f"{traffic['intra_domain'] / 1e6:.2f} MB inside domains "
        f"(logical gradient {traffic['logical'] / 1e6:.2f} MB)")

  writer = MetricsWriter(config.workdir)
  writer.event("resume" if source is not None else "start", step=start_step,
               data_cursor=cursor, plan=plan.summary())
  degrees = [r.degree for r in plan.replicas]
  losses = []
  step, saved_step = start_step, start_step if source is not None else None

  def save(done: int) -> float:
    meta = {"data_cursor": cursor, "plan": plan.summary(),
            "config": json.loads(config.to_json_best_effort())}
    return checkpoints.save(done, logical_state(programs), meta)

  try:
    while step < config.train.steps and stop.received is None:
      batch = dataset.sequences(cursor, plan.global_batch)
      start = time.perf_counter()
      metrics = job_step(batch)
      loss = float(metrics["loss"])  # blocks until the step is done
      elapsed = time.perf_counter() - start
      if not np.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} at step {step}; lower train.lr")
      cursor += plan.global_batch
      record = {"step": step, "loss": loss, "tokens": global_tokens, "step_time_s": elapsed,
                "tp_degree": min(degrees), "tp_degrees": degrees,
                "grad_norm": float(metrics["grad_norm"]), "global_batch": plan.global_batch,
                "data_cursor": cursor}
      step += 1
      if checkpoints is not None and step % config.checkpoint.every == 0:
        record["checkpoint_s"] = save(step)
        saved_step = step
      writer.write(record)
      losses.append(loss)
      if record["step"] % config.train.log_every == 0 or step == config.train.steps:
        log(progress_line(record, config.train.steps))
    if checkpoints is not None and saved_step != step:
      save(step)
      saved_step = step
    if checkpoints is not None:
      checkpoints.wait()
    where = checkpoints.step_dir(saved_step) if saved_step is not None else None
    if stop.received is not None:
      writer.event("stop", step=step, signal=stop.received, checkpoint=where)
      saved = (f"checkpoint written to {where}" if where else
               "no checkpoint written (checkpoint.every=0)")
      log(f"interrupted at step {step} ({stop.received}); {saved}")
    elif where:
      log(f"checkpoint written to {where}")
  finally:
    writer.close()
  return {"losses": losses, "plan": plan, "programs": programs, "start_step": start_step,
          "interrupted": stop.received is not None, "checkpoint": where,
          "metrics_path": os.path.join(config.workdir, "metrics.jsonl")}
