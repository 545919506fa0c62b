"""``python -m ntp_jax.generate``: continue a prompt with a trained or imported model.

  python -m ntp_jax.generate --from hf:FOLDER --prompt "def main(" --max-new-tokens 32
  python -m ntp_jax.generate --from runs/tiny --prompt "import " --config.mesh.tp=8 \\
      --config.ntp.failed=3 --temperature 0.8 --top-k 40 --seed 1

``--from`` is ``hf:FOLDER`` (a Hugging Face Llama folder with
``tokenizer.json``) or a run's workdir, checkpoint folder or step folder.
The model runs on one TP group of ``--config.mesh.tp`` slots (default 1)
with ``--config.ntp.failed`` slots left out, in the padded blocks training
uses. It prints the prompt and its continuation to stdout, and what it loaded
and how long it took to stderr. Every bad input is one line naming the flag,
field or file, and exit status 2. On a machine without an accelerator,
``mesh.tp`` CPU devices are simulated (set before JAX starts) unless
``XLA_FLAGS`` already sets a count.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

USAGE_ERROR = 2
SETTINGS = ("mesh.tp", "ntp.failed", "ntp.slot_weights")  # besides model.<field>
_PREFIX = "--config."


class _Parser(argparse.ArgumentParser):
  """argparse whose errors are one line and exit status 2."""

  def error(self, message: str):
    raise _UsageError(message)


class _UsageError(Exception):
  pass


# What --help says of the settings argparse does not declare (``parse_overrides`` reads them).
_SETTINGS_HELP = """settings, as --config.FIELD=VALUE (the names train.py's flags take):
  --config.mesh.tp=N        slots of the TP group (default 1: one device)
  --config.ntp.failed=S,..  slots left out, e.g. 3 (TP degree 7 of 8)
  --config.ntp.slot_weights=W,..
                            per-slot relative speeds, as for training
  --config.model.FIELD=V    a field of the model, typed as the field (the GPT's: dtype,
                            param_dtype, ffn_granularity, ...); --config.model.factory
                            reads an hf: folder as another model than the GPT

example:
  python -m ntp_jax.generate --from runs/tiny --prompt "def __init__(self" \\
      --config.mesh.tp=8 --config.ntp.failed=3 --temperature 0.8 --top-k 40
"""


def _parser() -> _Parser:
  parser = _Parser(prog="python -m ntp_jax.generate",
                   usage="%(prog)s --from ORIGIN --prompt PROMPT [options] "
                         "[--config.FIELD=VALUE ...]",
                   description="Continue a prompt with a model from a Hugging Face folder "
                               "or a run's checkpoint, on any TP plan.",
                   epilog=_SETTINGS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--from", dest="origin", required=True,
                      help="hf:FOLDER, or a run's workdir / checkpoint folder / step folder")
  parser.add_argument("--prompt", required=True, help="the text to continue")
  parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to add (default 32)")
  parser.add_argument("--temperature", type=float, default=0.0,
                      help="0: greedy (default); above 0: sample at this temperature")
  parser.add_argument("--top-k", type=int, default=0,
                      help="sample among the k most likely tokens (0: all)")
  parser.add_argument("--seed", type=int, default=0, help="seed of sampling")
  parser.add_argument("--step", type=int, default=None,
                      help="checkpoint step (default: the newest complete one)")
  return parser


def parse_overrides(extra: Sequence[str]) -> dict[str, str]:
  """``--config.SECTION.FIELD=VALUE`` arguments -> ``{"SECTION.FIELD": "VALUE"}``.

  Raises:
    ConfigError: an argument of another form, or a field generation does not read
      (``SETTINGS`` and ``model.<field>``), naming it.
  """
  from ntp_jax.errors import ConfigError
  out = {}
  for arg in extra:
    if not arg.startswith(_PREFIX) or "=" not in arg:
      raise ConfigError(f"{arg.split('=')[0]}: unknown argument (flags: --from, --prompt, "
                        "--max-new-tokens, --temperature, --top-k, --seed, --step, "
                        "--config.FIELD=VALUE)")
    name, value = arg[len(_PREFIX):].split("=", 1)
    if name not in SETTINGS and not name.startswith("model."):
      raise ConfigError(f"--config.{name}: not a generation setting (those are "
                        f"{', '.join(SETTINGS)} and model.<field>)")
    out[name] = value
  return out


def model_overrides(overrides: dict[str, str]) -> dict[str, str]:
  """The ``model.<field>`` overrides as ``{field: text}``; the model's fields type them
  (``origin.open_origin``)."""
  return {name[len("model."):]: text for name, text in overrides.items()
          if name.startswith("model.")}


def _simulate_cpu_devices(count: int) -> None:
  """Ask XLA for ``count`` host devices unless a count is set (only the CPU reads it)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def main(argv: Sequence[str] | None = None) -> int:
  """Run the command; returns the exit status (0, or 2 after a one-line error)."""
  try:
    args, extra = _parser().parse_known_args(argv)
    overrides = parse_overrides(extra)
  except _UsageError as err:
    print(f"generate: {err}", file=sys.stderr)
    return USAGE_ERROR
  except ValueError as err:  # ConfigError
    print(f"generate: {err}", file=sys.stderr)
    return USAGE_ERROR
  tp_text = overrides.get("mesh.tp", "1")
  if not tp_text.isdigit() or int(tp_text) < 1:
    print(f"generate: --config.mesh.tp: expected a whole number >= 1, got {tp_text!r}",
          file=sys.stderr)
    return USAGE_ERROR
  _simulate_cpu_devices(int(tp_text))  # before JAX starts its backend

  from ntp_jax.data.errors import DataError
  from ntp_jax.errors import ConfigError
  try:
    return _generate(args, overrides, int(tp_text))
  except (ConfigError, DataError) as err:
    print(f"generate: {err}", file=sys.stderr)
    return USAGE_ERROR


def _generate(args, overrides: dict[str, str], tp: int) -> int:
  import time

  from ntp_jax.errors import ConfigError, too_few_devices
  from ntp_jax.generate.decoder import Decoder
  from ntp_jax.generate.origin import open_origin, place
  from ntp_jax.generate.prompt import PromptCodec
  from ntp_jax.generate.sampling import Sampling
  from ntp_jax.sharding.layout import live_slots
  from ntp_jax.training.config import parse_failed, parse_weights

  if args.max_new_tokens < 1:
    raise ConfigError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
  sampling = Sampling(args.temperature, args.top_k)
  failed = sorted(slot for _, slot in parse_failed(overrides.get("ntp.failed", ""), 1, tp))
  weights = parse_weights(overrides.get("ntp.slot_weights", ""), tp)
  if len(failed) >= tp:
    raise ConfigError(f"ntp.failed: every one of the mesh.tp={tp} slots has failed")
  origin = open_origin(args.origin, model_overrides(overrides), args.step)
  codec = PromptCodec(origin)
  prompt = codec.encode(args.prompt)
  if len(prompt) > origin.max_len:
    raise ConfigError(f"--prompt: {len(prompt)} tokens, longer than the model's maximum "
                      f"sequence length {origin.max_len} ({origin.max_len_field})")
  room = origin.max_len - len(prompt)
  if args.max_new_tokens > room:
    raise ConfigError(f"--max-new-tokens: {args.max_new_tokens} after the prompt's "
                      f"{len(prompt)} tokens pass the model's maximum sequence length "
                      f"{origin.max_len} ({origin.max_len_field}); at most {room}")
  import jax
  if len(jax.devices()) < tp:  # before any weight is read
    raise too_few_devices(("mesh.tp",), tp, len(jax.devices()), jax.devices()[0].platform)
  log = lambda line: print(line, file=sys.stderr)  # noqa: E731
  log(f"model: {origin.description}")
  log(f"tokenizer: {origin.tokenizer}")
  start = time.perf_counter()
  model, mesh = place(origin, tp, tuple(failed), weights)
  layouts, describe = model.layouts, origin.spec.decoding.describe
  slots = ",".join(map(str, live_slots(tp, failed)))
  log(f"plan: TP degree {layouts.degree} (mesh.tp={tp}, live slots {slots}); "
      f"{describe(layouts) + '; ' if describe else ''}"
      f"placed in {time.perf_counter() - start:.2f} s")
  decoder = Decoder(model, mesh, sampling)
  out = decoder.generate(prompt[None], args.max_new_tokens, seed=args.seed,
                         stop_token=codec.stop_token)
  new = [int(t) for t in out.tokens[0]]
  print(codec.decode(list(prompt) + new), flush=True)  # before the closing stderr line
  stopped = " (stopped at the end-of-text token)" if codec.stop_token in new else ""
  steps = max(len(new) - 1, 1)
  log(f"{len(new)} new tokens{stopped}, {sampling.describe()}: compiled in {out.compile_s:.2f} s, "
      f"prompt of {len(prompt)} tokens in {out.prefill_s * 1e3:.1f} ms, then "
      f"{out.decode_s / steps * 1e3:.1f} ms per token")
  return 0
