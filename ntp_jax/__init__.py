"""ntp_jax: nonuniform tensor parallelism (NTP) for fault-tolerant LLM training in JAX.

A DP replica that loses devices of its TP group trains on at a reduced TP
degree beside healthy replicas (Arfeen et al., arXiv:2504.06095). The public
API, for a training run from Python (``docs/python_api.md``)::

  import configs.gpt_tiny
  import ntp_jax

  config = configs.gpt_tiny.get_config()      # an ml_collections.ConfigDict
  result = ntp_jax.train(config, hooks=[lambda info: print(info.step, info.loss)])

Names resolve on first use, so ``import ntp_jax`` starts no JAX backend:
``XLA_FLAGS`` (a simulated CPU device count) may still be set after it.

Packages, bottom to top (each imports only those below it; docs/design.md):
``sharding`` (uneven shards and their collectives), ``layers`` (tensor-parallel
Flax layers), ``state`` (logical state on and off a plan), ``parallel`` (the
plan, class programs, gradient sync), ``model`` (what a model provides),
``train`` (the trainer), ``interop`` and ``generate`` (Hugging Face in and
out, text generation); ``resilience``, ``data`` and ``sim`` stand beside them.
"""

import importlib

# Public name -> the module that defines it.
_EXPORTS = {
  "train": "ntp_jax.training.trainer",
  "TrainResult": "ntp_jax.training.trainer",
  "Hook": "ntp_jax.training.hooks",
  "StepInfo": "ntp_jax.training.hooks",
  "RunServices": "ntp_jax.training.hooks",
  "ProcessStop": "ntp_jax.training.process_guard",
  "RunConfig": "ntp_jax.training.config",
  "ModelSpec": "ntp_jax.model",
  "load_model_spec": "ntp_jax.model",
  "Plan": "ntp_jax.parallel.plan",
  "make_plan": "ntp_jax.parallel.plan",
  "Layout": "ntp_jax.sharding.layout",
  "make_layout": "ntp_jax.sharding.layout",
  "Event": "ntp_jax.resilience.events",
  "DeviceFailure": "ntp_jax.resilience.events",
  "ConfigError": "ntp_jax.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'ntp_jax' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value  # resolved once
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
