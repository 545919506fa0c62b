"""Helpers shared by the test modules: the repository root, a small ``gpt_micro`` config for
``train()``, and a small NTP job (any plan) on random tokens that reads back every replica's
state.

Test modules take shared helpers from here (and from layer_check, reference, tp_cases), never
from another ``test_*.py`` module.
"""

import functools
import os
import re

import jax
import numpy as np
import optax
from codegen import COST_ANALYSIS_FLAGS, without_codegen_flags
from flax import nnx

import configs.gpt_micro
from models.gpt import GPT, GPTConfig, model_layouts
from ntp_jax.layers.shard import replica_view, to_logical
from ntp_jax.parallel.plan import make_plan
from ntp_jax.parallel.programs import build_class_programs
from ntp_jax.parallel.step_modes import make_job_step
from ntp_jax.training.config import parse_failed, parse_weights
from ntp_jax.training.hooks import Hook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def process_env(devices=None, codegen=True, **extra):
  """The environment for a subprocess: this one's, with ``XLA_FLAGS`` keeping the suite's
  codegen flags (``tests/codegen.py``) but not its device count, plus ``extra``.

  ``devices``: CPU devices to simulate; None leaves the count to the command (``train.py``
  gives each process ``mesh.dp * mesh.tp / processes`` devices). ``codegen=False``: the
  production codegen (for bf16 numerics, long runs); ``"cost"``: its HLO passes without
  LLVM's (for XLA's cost analysis, ``tests/codegen.py``).
  """
  env = dict(os.environ)
  flags = env.get("XLA_FLAGS", "") if codegen is True else without_codegen_flags(
      env.get("XLA_FLAGS", ""))
  flags = [f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count")]
  if codegen == "cost":
    flags += COST_ANALYSIS_FLAGS
  if devices is not None:
    flags.append(f"--xla_force_host_platform_device_count={devices}")
  env["XLA_FLAGS"] = " ".join(flags)
  env.setdefault("JAX_PLATFORMS", "cpu")
  env.update(extra)
  return env


_FATAL = re.compile(r"F\d{4} |Check failed|terminate called|what\(\)|Fatal Python error|Aborted")


def job_output_tail(output: str, chars: int = 3000) -> str:
  """A failed job's output for an assertion message: its last ``chars`` characters, after
  every line that says why a process was aborted (a C++ check or an uncaught exception),
  wherever it stands: those come before the Python dump that fills the tail."""
  fatal = [line for line in output.splitlines() if _FATAL.search(line)]
  return "\n".join(fatal + ["..."] + [output[-chars:]])


def micro_config(workdir, **overrides):
  """``configs/gpt_micro.py`` cut to 10 steps on a 300 kB corpus, no checkpoints, plots or eval.

  Overrides are ``{"section.field": value}``, e.g. ``{"mesh.tp": 1}``.
  """
  c = configs.gpt_micro.get_config()
  c.workdir = str(workdir)
  c.train.steps = 10
  c.train.log_every = 5
  c.data.max_corpus_bytes = 300_000
  c.checkpoint.every = 0  # these runs share a workdir: none may resume another's checkpoint
  c.train.plot = False
  c.train.eval_every = 0  # validation has its own tests (test_output.py); keep these runs lean
  for key, value in overrides.items():
    section, field = key.split(".")
    c[section][field] = value
  return c


# Uneven everywhere: 8 KV heads (16 query heads), d_ff 20 in units of 4, vocabulary 37.
SMALL = GPTConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=16, n_kv_heads=8, head_dim=4,
                  d_ff=20, ffn_granularity=4, rope_theta=10_000.0)
SEQ = 6


def _raise_or_pass(phase, error):
  """A commit vote of one process: a phase passes unless its collectives raised."""
  if error is not None:
    raise error


def run_job(*, tp, dp, failed="", rebalance="equal", slot_weights="", batch_size=4, steps=3,
            optimizer=None, clip_norm=1.0, cfg=SMALL, seed=0, microbatches=1, commit=False):
  """Returns (losses, plan, [logical params of every live replica], [opt states]).

  ``commit``: the steps of a recoverable multi-process job (``CommittedJobStep``'s ``commit``: the
  split programs, ``SplitStep.finish`` and ``apply_grads``), its votes passing at once."""
  plan = make_plan(functools.partial(model_layouts, cfg), tp=tp, dp=dp,
                   failed=parse_failed(failed, dp, tp),
                   slot_weights=parse_weights(slot_weights, tp), batch_size=batch_size,
                   rebalance=rebalance, microbatches=microbatches)
  # SGD with momentum and decoupled weight decay keeps parity checks tight: Adam divides
  # each gradient entry by its own magnitude, which amplifies rounding in near-zero entries.
  optimizer = optimizer or optax.chain(optax.add_decayed_weights(0.1),
                                       optax.sgd(0.3, momentum=0.9))
  programs = build_class_programs(plan, lambda layouts: GPT(cfg, layouts, rngs=nnx.Rngs(seed)),
                                  optimizer, clip_norm, plan.global_batch * SEQ,
                                  jax.devices()[:tp * dp], split=commit)
  job = make_job_step(plan, programs, split=commit, commit=_raise_or_pass if commit else None)
  losses = []
  for step in range(steps):
    losses.append(float(job(global_batch(plan.global_batch, step, cfg))["loss"]))
  params = [jax.tree.map(np.asarray, to_logical(replica_view(p.params, r)))
            for p in programs for r in range(p.replicas)]
  return losses, plan, params, programs


def global_batch(rows, step, cfg=SMALL):
  return np.asarray(jax.random.randint(jax.random.key(1000 + step), (rows, SEQ + 1), 0,
                                       cfg.vocab_size), np.int32)


def assert_trees_close(a, b, rtol=2e-5, atol=2e-6):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


class WaitForAhead(Hook):
  """Before each event step, lets the background compile finish (a long run's failures
  come long after it has)."""

  def __init__(self, steps):
    self.steps = steps

  def before_step(self, step, services):
    if step in self.steps:
      assert services.wait_for_compile_ahead(600)
    return []


class KeyValueStore:
  """The coordination service's key-value store, in one process: the client calls the
  library makes on it (a blocking read of a missing key times out at once)."""

  def __init__(self):
    self.values = {}

  def key_value_set(self, key, value, allow_overwrite=False):
    self.values[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    if key not in self.values:
      raise TimeoutError(key)
    return self.values[key]

  def key_value_try_get(self, key):
    if key not in self.values:
      raise RuntimeError(f"NOT_FOUND: {key}")
    return self.values[key]

  def key_value_delete(self, key):
    self.values.pop(key, None)
