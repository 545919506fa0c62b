"""The training loop: config -> plan -> per-class programs -> steps -> metrics.

``train.py`` only parses flags and calls ``train(config)``. One program is
compiled per replica class (see ``ntp_jax.plan``); each runs over its own
sub-mesh of the job's devices.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from models.gpt import GPT, GPTConfig, model_layouts
from ntp_jax.data import make_dataset
from ntp_jax.errors import ConfigError
from ntp_jax.metrics import MetricsWriter, progress_line
from ntp_jax.optim import make_optimizer
from ntp_jax.plan import Plan, make_plan
from ntp_jax.replica_class import JobStep, build_class_programs
from ntp_jax.report import parameter_table
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


def train(config, *, log=print) -> dict[str, Any]:
  """Train the model of ``config`` and return a summary.

  Writes ``<workdir>/metrics.jsonl`` (one JSON object per step: ``step``,
  ``loss``, ``tokens``, ``step_time_s``, ``tp_degree`` (the smallest live TP
  degree), ``tp_degrees`` (one per live replica), ``grad_norm``,
  ``global_batch``) and logs a progress line every ``train.log_every`` steps.

  Raises:
    ConfigError, DataError: bad settings or input (one line naming the field).
  """
  check_train_fields(config.train)
  cfg = GPTConfig.from_config(config.model)
  optimizer = make_optimizer(config.train)  # validates the optimizer fields up front
  plan = plan_from_config(config, cfg)
  devices = check_devices(plan)
  log(plan.describe())

  seq_len = config.train.seq_len
  dataset = make_dataset(config.data.path or None, cfg.vocab_size, seq_len, config.workdir,
                         config.train.seed, max_corpus_bytes=config.data.max_corpus_bytes)
  dataset.check_batch_size(plan.global_batch)
  log(dataset.describe())

  global_tokens = plan.global_batch * seq_len
  programs = build_class_programs(
      plan, lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(config.train.seed)), optimizer,
      config.train.clip_norm, global_tokens, devices)
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
  degrees = [r.degree for r in plan.replicas]
  losses = []
  try:
    for step in range(config.train.steps):
      batch = dataset.batch(step, plan.global_batch)
      start = time.perf_counter()
      metrics = job_step(batch)
      loss = float(metrics["loss"])  # blocks until the step is done
      elapsed = time.perf_counter() - start
      if not np.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} at step {step}; lower train.lr")
      record = {"step": step, "loss": loss, "tokens": global_tokens, "step_time_s": elapsed,
                "tp_degree": min(degrees), "tp_degrees": degrees,
                "grad_norm": float(metrics["grad_norm"]), "global_batch": plan.global_batch}
      writer.write(record)
      losses.append(loss)
      if step % config.train.log_every == 0 or step == config.train.steps - 1:
        log(progress_line(record, config.train.steps))
  finally:
    writer.close()
  return {"losses": losses, "plan": plan, "programs": programs,
          "metrics_path": os.path.join(config.workdir, "metrics.jsonl")}
