"""Programs compiled ahead for the plans one failure away, on CPU and on GPU.

  python bench/precompile_programs.py [--config configs/gpt_tiny.py] [--tp 8] [--dp 1,2]
                                      [--out docs/bench_precompile_programs.md]

For each DP size, the healthy job (``--tp`` slots per replica, no failed
slot) is built, and every plan one more failure of any device gives is
lowered and compiled as the trainer's compile ahead does it
(``programs.PlanPrograms.lower`` with a ``PeerSource`` over the healthy state: the
state moves, each class's step halves and the cross-class sync; a class
step met before in another plan is not lowered again). Printed per DP size:

- *CPU compiles*: the XLA compilations that ran (``jax.monitoring``'s
  backend-compile events; JAX itself reuses a lowering equal to one it
  compiled before on the same devices). On CPU the device ids are part of
  the persistent-cache key, so each device set compiles its own.
- *GPU compiles*: the distinct lowered programs among them (equal StableHLO
  text). On GPU the persistent compilation cache key leaves out the device
  assignment (``jax/_src/cache_key.py``: ``strip_device_assignment=
  (backend.platform == "gpu")``), so equal programs on other devices load
  the one compiled entry instead of compiling.
- the host memory the process grew by while compiling them (resident set).

The model is the config's (default gpt_tiny): the counts depend on the plan
and the model's structure, not its size. The persistent cache is off.
"""

import argparse
import functools
import hashlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import emit, load_config, simulate_cpu_devices  # noqa: E402


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_tiny.py"))
  parser.add_argument("--tp", type=int, default=8)
  parser.add_argument("--dp", default="1,2", help="DP sizes, comma-separated")
  parser.add_argument("--out", default="")
  return parser.parse_args()


ARGS = parse_args()
DPS = [int(d) for d in ARGS.dp.split(",")]
simulate_cpu_devices(max(DPS) * ARGS.tp)

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from models.gpt import GPT, GPTConfig, model_layouts  # noqa: E402
from ntp_jax.parallel.plan import make_plan, reachable_failed_sets  # noqa: E402
from ntp_jax.parallel.programs import PlanPrograms, ProgramCache, build_class_programs  # noqa: E402
from ntp_jax.state.peer import PeerSource  # noqa: E402
from ntp_jax.training.compilation import host_resident_bytes, set_up_cache  # noqa: E402
from ntp_jax.training.config import RunConfig  # noqa: E402
from ntp_jax.training.optim import make_optimizer  # noqa: E402

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_compiles = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _, **__: _compiles.__setitem__(0, _compiles[0] + (event == BACKEND_COMPILE)))


def kind(what: str) -> str:
  return what.split(" (")[0]


def count(dp: int, config) -> dict:
  """Compile every program of the plans one failure away from the healthy ``dp x tp`` job."""
  run = RunConfig.from_config(config)
  cfg = GPTConfig.from_config(config.model)
  layouts = functools.partial(model_layouts, cfg)
  tp, seq = ARGS.tp, run.train.seq_len
  optimizer = make_optimizer(run.train)
  devices = jax.devices()[:dp * tp]

  def make_model(layouts):
    return GPT(cfg, layouts, rngs=nnx.Rngs(run.train.seed))

  def plan_of(failed):
    return make_plan(layouts, tp=tp, dp=dp, failed=failed, batch_size=run.train.batch_size,
                     rebalance="proportional", microbatches=run.train.microbatches)

  cache = ProgramCache()
  healthy = plan_of(frozenset())
  programs = build_class_programs(healthy, make_model, optimizer, run.train.clip_norm,
                                  healthy.global_batch * seq, devices, cache=cache)
  lowered_total, texts, by_kind, plans = 0, set(), {}, 0
  rss, compiles, start = host_resident_bytes(), _compiles[0], time.perf_counter()
  for failed in reachable_failed_sets(frozenset(), dp=dp, tp=tp):
    plan = plan_of(failed)
    dead = {devices[r * tp + s] for r, s in failed}
    source = PeerSource(programs, dead, cache=cache)
    made = PlanPrograms(plan, make_model, optimizer, run.train.clip_norm, plan.global_batch * seq,
                        devices, cache=cache).lower(seq, source, skip=cache.compiled_keys())
    plans += 1
    left = {}
    for what, key, lowered in made:
      lowered_total += 1
      texts.add(hashlib.sha256(lowered.as_text().encode()).hexdigest())
      by_kind[kind(what)] = by_kind.get(kind(what), 0) + 1
      lowered.compile()
      if key is not None:
        left[key] = left.get(key, 0) + 1
    cache.mark_compiled(left)
  return {"plans": plans, "lowered": lowered_total, "cpu": _compiles[0] - compiles,
          "gpu": len(texts), "kinds": by_kind, "seconds": time.perf_counter() - start,
          "rss_gb": (host_resident_bytes() - rss) / 2**30}


def main():
  set_up_cache("none", "")
  config = load_config(ARGS.config)
  config.mesh.tp = ARGS.tp
  rows = []
  for dp in DPS:
    config.mesh.dp = dp
    rows.append((dp, count(dp, config)))
  lines = [f"`python bench/precompile_programs.py --config {os.path.relpath(ARGS.config, ROOT)} "
           f"--tp {ARGS.tp} --dp {ARGS.dp}` ({jax.devices()[0].platform}, "
           f"{len(jax.devices())} devices)", "",
           "| DP x TP | plans one failure away | programs lowered (moves, class programs, "
           "sync) | CPU compiles | GPU compiles (distinct programs) | compile wall time | "
           "host memory grown |",
           "|---|---|---|---|---|---|---|"]
  for dp, r in rows:
    kinds = ", ".join(f"{r['kinds'].get(k, 0)}" for k in ("state move", "class program",
                                                          "cross-class sync"))
    lines.append(f"| {dp} x {ARGS.tp} | {r['plans']} | {r['lowered']} ({kinds}) | {r['cpu']} | "
                 f"{r['gpu']} | {r['seconds']:.1f} s | {r['rss_gb']:.2f} GiB |")
  emit(lines, ARGS.out)


if __name__ == "__main__":
  main()
