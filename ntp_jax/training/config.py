"""The run's settings as frozen dataclasses, built and checked once from the config file.

``configs/*.py`` return an ``ml_collections.ConfigDict`` (overridable on the
command line as ``--config.train.steps=100``); ``RunConfig.from_config``
turns it into one typed value at the edge (``train.py``, ``train()``), and
every check of a field happens there, each error one line naming the field
(a ``ConfigError``). Past the edge the library reads attributes only: no
``.get(key, default)``, no text to parse. Parsed values flow inward: the
failed slots as a set of ``(replica, slot)`` pairs, events as
``events.Event`` objects, slot weights as numbers.

Every field of every section is required: ``configs/base.py`` holds each
with its default and a comment, the one place defaults live; a config
without one, or with a field no section has, is refused. The ``model``
section belongs to the model factory (``model.factory``, e.g.
``models.gpt.GPTConfig.from_config`` checks the GPT's fields); the trainer
reads ``model.factory`` and ``model.init_from`` of it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
from typing import Any

from ntp_jax.errors import ConfigError
from ntp_jax.parallel.plan import REBALANCE
from ntp_jax.processes.distributed import local_device_ids
from ntp_jax.resilience.events import Event, check_events, parse_events

PRECOMPILE = ("auto", "next_failure", "none")  # ``ntp.precompile`` (ntp_jax.training.precompile)
RECOVERY = ("live", "restart")  # where a failure's new plan takes its state (``ntp.recovery``)
# ``train.optimizer_sharding`` (ntp_jax.parallel.zero)
OPTIMIZER_SHARDING = ("replicated", "zero1", "zero2")
FailedSlots = frozenset[tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class ModelSection:
  """What the trainer reads of ``model``; the rest is the factory's."""

  factory: str  # "module:function": config -> ModelSpec
  init_from: str  # "" or "hf:FOLDER"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  tp: int  # slots per TP group (devices per scale-up domain)
  dp: int  # DP replicas

  @property
  def devices(self) -> int:
    return self.tp * self.dp


@dataclasses.dataclass(frozen=True)
class NTPConfig:
  failed: FailedSlots  # (replica, slot) pairs failed at launch
  slot_weights: tuple[float, ...] | None  # relative speed per slot; None: equal
  rebalance: str  # one of REBALANCE
  events: tuple[Event, ...]  # ntp.fail_at and ntp.repair_at, sorted
  recovery: str  # one of RECOVERY
  precompile: str  # one of PRECOMPILE: compile the plans one failure or repair away, ahead
  precompile_max_programs: int  # programs compiled ahead per plan change (0: no bound)
  precompile_max_host_gb: float  # stop compiling ahead past this host-memory growth (0: none)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int
  seed: int
  batch_size: int  # sequences per step of the healthy job
  seq_len: int
  microbatches: int  # micro-batches of a healthy replica's share (gradients summed)
  lr: float
  min_lr_ratio: float
  warmup_steps: int
  schedule_steps: int  # learning-rate schedule length (``train.schedule_steps``, 0 -> ``steps``)
  b1: float
  b2: float
  weight_decay: float
  clip_norm: float
  optimizer_sharding: str  # one of OPTIMIZER_SHARDING
  optimizer_copies: int  # zero1/zero2: replicas holding each piece of the optimizer state
  log_every: int
  eval_every: int  # 0: no validation loss
  eval_sequences: int
  tensorboard: bool
  plot: bool


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  every: int  # 0: no checkpoints at all
  keep: int
  dir: str  # the folder (``checkpoint.dir``, or WORKDIR/checkpoints when that is empty)
  resume: bool
  dir_field: str  # the field that named ``dir``, for errors: checkpoint.dir or workdir

  @property
  def enabled(self) -> bool:
    return self.every > 0


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  coordinator: str  # host:port of process 0; "" from the launcher or the cluster
  num_processes: int  # 0: from the launcher or the cluster
  process_id: int  # -1: from the launcher or the cluster
  processes_per_domain: int
  heartbeat_timeout_s: float
  # Survivors of a lost process write the last completed step within this many seconds
  # (a just-in-time checkpoint), then stop; 0: off (docs/multihost.md)
  jit_checkpoint_s: float
  # The survivors go on with their replicas (jax_enable_recoverability) instead of stopping
  recoverable: bool
  # Recoverable CPU jobs: a collective's bound (0: from heartbeat_timeout_s)
  collective_timeout_s: float = 0.0
  # JAX's coordination service runs outside the workers (python -m ntp_jax.coordinator)
  external_coordinator: bool = False
  # The devices this process drives: "" JAX's choice, "all", or ids "0,1" (local_device_ids)
  local_device_ids: str = ""


@dataclasses.dataclass(frozen=True)
class CompileConfig:
  # JAX's persistent compilation cache: a folder; "" the default (JAX's own setting when the
  # environment gives one, else WORKDIR/compile_cache); "none" off (ntp_jax.training.compilation)
  cache_dir: str


@dataclasses.dataclass(frozen=True)
class DataConfig:
  path: str  # "" : the Python standard library's source
  max_corpus_bytes: int
  val_fraction: float


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """One training run's settings, checked (see the module docstring).

  Attributes:
    source: the ``ConfigDict`` it was built from: the model factory takes
      it, and checkpoints store it as JSON.
  """

  workdir: str
  dry_run: bool
  model: ModelSection
  mesh: MeshConfig
  ntp: NTPConfig
  train: TrainConfig
  checkpoint: CheckpointConfig
  distributed: DistributedConfig
  data: DataConfig
  compile: CompileConfig
  source: Any = dataclasses.field(repr=False, compare=False, default=None)

  @classmethod
  def from_config(cls, config: Any, file: str | None = None) -> RunConfig:
    """Build and check the run's settings from an ``ml_collections.ConfigDict``.

    Args:
      config: the settings.
      file: the config file they were loaded from, named by an unknown field's error
        (the command line's overrides cannot add fields: only the file can).

    Raises:
      ConfigError: one line naming the field: a missing or unknown field, a
        value of the wrong type or out of range, unparsable text
        (``ntp.failed``, ``ntp.slot_weights``, ``ntp.fail_at``,
        ``ntp.repair_at``), events that do not fit the launch failures, or a
        recovery with nothing to recover from.
    """
    reader = _Reader(config)
    _no_unknown_fields(config, file)
    mesh = MeshConfig(tp=reader.int("mesh.tp", low=1), dp=reader.int("mesh.dp", low=1))
    train = _train_section(reader)
    if train.optimizer_sharding != "replicated" and mesh.dp == 1:
      raise ConfigError(f"train.optimizer_sharding: {train.optimizer_sharding} splits the "
                        "optimizer state over the DP replicas, and mesh.dp=1 has one; use "
                        "replicated")
    if train.optimizer_copies > mesh.dp:
      raise ConfigError(f"train.optimizer_copies: {train.optimizer_copies} copies of each piece "
                        f"need as many replicas; mesh.dp={mesh.dp}")
    if train.batch_size % mesh.dp:
      raise ConfigError(f"train.batch_size: {train.batch_size} sequences do not split evenly "
                        f"over mesh.dp={mesh.dp} replicas")
    if (train.batch_size // mesh.dp) % train.microbatches:
      raise ConfigError(f"train.microbatches: a replica's {train.batch_size // mesh.dp} "
                        f"sequences (train.batch_size / mesh.dp) do not split into "
                        f"{train.microbatches} equal micro-batches")
    workdir = reader.str("workdir")
    if not workdir:
      raise ConfigError("workdir: must not be empty")
    checkpoint_dir = reader.str("checkpoint.dir")
    checkpoint = CheckpointConfig(
        every=reader.int("checkpoint.every", low=0), keep=reader.int("checkpoint.keep", low=1),
        dir=checkpoint_dir or os.path.join(workdir, "checkpoints"),
        resume=reader.bool("checkpoint.resume"),
        dir_field="checkpoint.dir" if checkpoint_dir else "workdir")
    ntp = _ntp_section(reader, mesh, train, checkpoint)
    distributed = DistributedConfig(
        coordinator=reader.str("distributed.coordinator"),
        num_processes=reader.int("distributed.num_processes", low=0),
        process_id=reader.int("distributed.process_id", low=-1),
        processes_per_domain=reader.int("distributed.processes_per_domain", low=1),
        heartbeat_timeout_s=reader.float("distributed.heartbeat_timeout_s", positive=True),
        jit_checkpoint_s=reader.float("distributed.jit_checkpoint_s", low=0.0),
        recoverable=reader.bool("distributed.recoverable"),
        collective_timeout_s=reader.float("distributed.collective_timeout_s", low=0.0),
        external_coordinator=reader.bool("distributed.external_coordinator"),
        local_device_ids=reader.str("distributed.local_device_ids"))
    local_device_ids(distributed.local_device_ids)  # a bad value: one line, on any process count
    data = DataConfig(path=reader.str("data.path"),
                      max_corpus_bytes=reader.int("data.max_corpus_bytes", low=1),
                      val_fraction=reader.float("data.val_fraction", low=0.0))
    if data.val_fraction >= 1:
      raise ConfigError(f"data.val_fraction: must be below 1, got {data.val_fraction}")
    model = ModelSection(factory=reader.str("model.factory"),
                         init_from=reader.str("model.init_from"))
    compile_config = CompileConfig(cache_dir=reader.str("compile.cache_dir"))
    return cls(workdir=workdir, dry_run=reader.bool("dry_run"), model=model, mesh=mesh,
               ntp=ntp, train=train, checkpoint=checkpoint, distributed=distributed,
               data=data, compile=compile_config, source=config)

  def to_json_dict(self) -> dict[str, Any]:
    """The config as written (JSON-ready), for checkpoint metadata, with the learning-rate
    schedule's length resolved (``train.schedule_steps``)."""
    written = json.loads(self.source.to_json_best_effort())
    written.setdefault("train", {})["schedule_steps"] = self.train.schedule_steps
    return written


# Every field the trainer reads, by section, as written in a config file; ``model`` also holds
# the factory's own fields. configs/base.py sets each of them (tests/unit/test_configs.py checks).
FIELDS: dict[str, tuple[str, ...]] = {
    "": ("workdir", "dry_run", "model", "mesh", "ntp", "train", "checkpoint", "distributed",
         "data", "compile"),
    "model": ("factory", "init_from"),
    "mesh": ("tp", "dp"),
    "ntp": ("failed", "slot_weights", "rebalance", "fail_at", "repair_at", "recovery",
            "precompile", "precompile_max_programs", "precompile_max_host_gb"),
    "train": tuple(f.name for f in dataclasses.fields(TrainConfig)),
    "checkpoint": ("every", "keep", "dir", "resume"),
    "distributed": tuple(f.name for f in dataclasses.fields(DistributedConfig)),
    "data": tuple(f.name for f in dataclasses.fields(DataConfig)),
    "compile": tuple(f.name for f in dataclasses.fields(CompileConfig)),
}


def _no_unknown_fields(config: Any, file: str | None = None) -> None:
  """Raises ConfigError naming a field that no section of the trainer has (and ``file``,
  the config file that set it, where known), with the closest field there is."""
  where = f"{file}: " if file else ""
  for key in config:
    if key not in FIELDS[""]:
      raise ConfigError(f"{where}{key}: no such config field{_closest(key, FIELDS[''])}")
  for section, fields in FIELDS.items():
    if section in ("", "model"):
      continue
    if section not in config:
      raise ConfigError(f"{section}: section missing from the config (configs/base.py has it)")
    for key in config[section]:
      if key not in fields:
        raise ConfigError(f"{where}{section}.{key}: no such config field"
                          f"{_closest(key, fields, section + '.')}")


def _closest(name: str, fields: tuple[str, ...], prefix: str = "") -> str:
  """``; did you mean PREFIX+FIELD?`` for the field most like ``name``, or nothing."""
  close = difflib.get_close_matches(name, fields, n=1)
  return f"; did you mean {prefix}{close[0]}?" if close else ""


class _Reader:
  """Typed reads of ``section.field`` from a ConfigDict, each error naming the field."""

  def __init__(self, config: Any):
    self.config = config

  def raw(self, name: str) -> Any:
    node = self.config
    for part in name.split("."):
      if part not in node:
        raise ConfigError(f"{name}: missing from the config (configs/base.py lists every field)")
      node = node[part]
    return node

  def int(self, name: str, low: int | None = None) -> int:
    value = self.raw(name)
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{name}: expected a whole number, got {value!r}")
    if low is not None and value < low:
      raise ConfigError(f"{name}: must be >= {low}, got {value}")
    return value

  def float(self, name: str, low: float | None = None, positive: bool = False) -> float:
    value = self.raw(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{name}: expected a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
      raise ConfigError(f"{name}: must be finite, got {value}")
    if positive and value <= 0:
      raise ConfigError(f"{name}: must be > 0, got {value}")
    if low is not None and value < low:
      raise ConfigError(f"{name}: must be >= {low:g}, got {value:g}")
    return value

  def str(self, name: str) -> str:
    value = self.raw(name)
    if not isinstance(value, str):
      raise ConfigError(f"{name}: expected text, got {value!r}")
    return value

  def bool(self, name: str) -> bool:
    value = self.raw(name)
    if not isinstance(value, bool):
      raise ConfigError(f"{name}: expected True or False, got {value!r}")
    return value


def _train_section(reader: _Reader) -> TrainConfig:
  train = TrainConfig(
      steps=reader.int("train.steps", low=1), seed=reader.int("train.seed"),
      batch_size=reader.int("train.batch_size", low=1), seq_len=reader.int("train.seq_len", low=1),
      microbatches=reader.int("train.microbatches", low=1),
      lr=reader.float("train.lr", low=0.0),
      min_lr_ratio=reader.float("train.min_lr_ratio", low=0.0),
      warmup_steps=reader.int("train.warmup_steps", low=0),
      schedule_steps=reader.int("train.schedule_steps", low=0) or reader.int("train.steps"),
      b1=reader.float("train.b1", low=0.0), b2=reader.float("train.b2", low=0.0),
      weight_decay=reader.float("train.weight_decay", low=0.0),
      clip_norm=reader.float("train.clip_norm", low=0.0),
      optimizer_sharding=reader.str("train.optimizer_sharding"),
      optimizer_copies=reader.int("train.optimizer_copies", low=1),
      log_every=reader.int("train.log_every", low=1),
      eval_every=reader.int("train.eval_every", low=0),
      eval_sequences=reader.int("train.eval_sequences"),
      tensorboard=reader.bool("train.tensorboard"), plot=reader.bool("train.plot"))
  for name in ("b1", "b2"):
    if getattr(train, name) >= 1:
      raise ConfigError(f"train.{name}: must be below 1, got {getattr(train, name)}")
  if train.optimizer_sharding not in OPTIMIZER_SHARDING:
    raise ConfigError(f"train.optimizer_sharding: {train.optimizer_sharding!r} is not one of "
                      f"{', '.join(OPTIMIZER_SHARDING)}")
  if train.optimizer_sharding == "replicated" and train.optimizer_copies != 1:
    raise ConfigError(f"train.optimizer_copies: {train.optimizer_copies} copies need "
                      "train.optimizer_sharding=zero1 or zero2 (a replicated state is on every "
                      "replica)")
  if train.eval_every and train.eval_sequences < 1:
    raise ConfigError(f"train.eval_sequences: must be >= 1, got {train.eval_sequences}")
  return train


def _ntp_section(reader: _Reader, mesh: MeshConfig, train: TrainConfig,
                 checkpoint: CheckpointConfig) -> NTPConfig:
  # What depends on the failure state (every replica dropped, live slots of weight 0) is
  # the plan's to check: it changes while the job runs (parallel.plan.make_plan).
  failed = parse_failed(reader.str("ntp.failed"), mesh.dp, mesh.tp)
  weights = parse_weights(reader.str("ntp.slot_weights"), mesh.tp)
  rebalance = reader.str("ntp.rebalance")
  if rebalance not in REBALANCE:
    raise ConfigError(f"ntp.rebalance: {rebalance!r} is not one of {', '.join(REBALANCE)}")
  recovery = reader.str("ntp.recovery")
  if recovery not in RECOVERY:
    raise ConfigError(f"ntp.recovery: {recovery!r} is not one of {', '.join(RECOVERY)}")
  precompile = reader.str("ntp.precompile")
  if precompile not in PRECOMPILE:
    raise ConfigError(f"ntp.precompile: {precompile!r} is not one of {', '.join(PRECOMPILE)}")
  where = dict(dp=mesh.dp, tp=mesh.tp, steps=train.steps)
  events = (parse_events(reader.str("ntp.fail_at"), "fail", **where)
            + parse_events(reader.str("ntp.repair_at"), "repair", **where))
  check_events(events, set(failed), mesh.tp, mesh.dp)
  if any(e.kind == "fail" for e in events) and not checkpoint.enabled:
    if recovery == "restart":
      raise ConfigError("ntp.recovery: 'restart' restores the last checkpoint, but "
                        "checkpoint.every=0 writes none")
    if mesh.dp == 1:
      raise ConfigError("ntp.fail_at: with mesh.dp=1 no DP peer holds a copy of the state and "
                        "checkpoint.every=0 writes no checkpoint to fall back to")
    # From a healthy start every slot holds a piece, so the first failure loses one.
    if train.optimizer_sharding != "replicated" and train.optimizer_copies == 1 and not failed:
      raise ConfigError("ntp.fail_at: with train.optimizer_copies=1 the first failed device's "
                        "piece of the optimizer state has no copy, and checkpoint.every=0 "
                        "writes no checkpoint to fall back to; set train.optimizer_copies=2 or "
                        "checkpoint.every=N (steps between checkpoints)")
  return NTPConfig(failed=failed, slot_weights=weights, rebalance=rebalance,
                   events=tuple(sorted(events)), recovery=recovery, precompile=precompile,
                   precompile_max_programs=reader.int("ntp.precompile_max_programs", low=0),
                   precompile_max_host_gb=reader.float("ntp.precompile_max_host_gb", low=0.0))


def parse_failed(text: str, dp: int, tp: int) -> FailedSlots:
  """``ntp.failed`` -> the failed ``(replica, slot)`` pairs.

  Accepts ``""``, bare slots of replica 0 (``"3"``, ``"3,5"``) and
  ``replica:slot`` pairs (``"1:3"``, ``"0:2,1:5,1:6"``), mixed freely.

  Raises:
    ConfigError: a malformed item, an unknown replica or slot, a duplicated pair.
  """
  text = str(text).strip()
  failed: set[tuple[int, int]] = set()
  if not text:
    return frozenset()
  for item in text.split(","):
    item = item.strip()
    match = re.fullmatch(r"(?:(\d+):)?(\d+)", item)
    if not match:
      within = f" (in {text!r})" if item != text else ""  # the item alone when it is all
      raise ConfigError(f"ntp.failed: {item!r}{within} is not a slot ('3') or a replica:slot "
                        "pair ('1:3')")
    replica, slot = int(match.group(1) or 0), int(match.group(2))
    if replica >= dp:
      raise ConfigError(f"ntp.failed: replica {replica} in {item!r} does not exist "
                        f"(mesh.dp={dp})")
    if slot >= tp:
      raise ConfigError(f"ntp.failed: slot {slot} in {item!r} does not exist (mesh.tp={tp})")
    if (replica, slot) in failed:
      raise ConfigError(f"ntp.failed: replica {replica} slot {slot} is listed twice in {text!r}")
    failed.add((replica, slot))
  return frozenset(failed)


def parse_weights(text: str, tp: int) -> tuple[float, ...] | None:
  """``ntp.slot_weights`` -> one relative speed per slot, or None (equal).

  Raises:
    ConfigError: naming ``ntp.slot_weights``: not numbers, not ``mesh.tp`` of
      them, a negative or non-finite weight, or all zero.
  """
  text = str(text).strip()
  if not text:
    return None
  try:
    weights = tuple(float(w) for w in text.split(","))
  except ValueError:
    raise ConfigError(f"ntp.slot_weights: {text!r} is not a comma-separated list of "
                      "numbers") from None
  if len(weights) != tp:
    raise ConfigError(f"ntp.slot_weights: {len(weights)} weights given, mesh.tp={tp} slots "
                      "need one each")
  if not all(math.isfinite(w) for w in weights):
    raise ConfigError(f"ntp.slot_weights: weights must be finite, got {text!r}")
  if any(w < 0 for w in weights):
    raise ConfigError(f"ntp.slot_weights: weights must be >= 0, got {text!r}")
  if not any(w > 0 for w in weights):
    raise ConfigError(f"ntp.slot_weights: at least one weight must be positive, got {text!r}")
  return weights


def as_run_config(config: Any) -> RunConfig:
  """``config`` itself when already a ``RunConfig``, else ``RunConfig.from_config(config)``."""
  return config if isinstance(config, RunConfig) else RunConfig.from_config(config)
