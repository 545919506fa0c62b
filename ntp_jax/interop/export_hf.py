"""``python -m ntp_jax.interop.export_hf --checkpoint DIR [--step N] --out FOLDER [--force]``.

Writes one step of a run's checkpoints (read with ``ntp_jax.training.stored_run``:
the ``meta`` item holds the run's config, the ``state`` item the logical
parameters) as a Hugging Face folder (the model's ``ModelSpec.export_hf``; for the GPT,
``ntp_jax.interop.hf_llama.export_hf``):
``config.json`` and a float32 ``model.safetensors``, and the run's tokenizer
(``ntp_jax.interop.hf_tokenizer``: ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``) from the copy the trainer keeps beside the
checkpoints. The parameters are read on this host with plain orbax (the
optimizer state is not read), so any device count works; the host needs
memory for the model in float32 twice.

``--out`` must be a new or empty folder: files already there (a config of
the user's, the shards and index of another model, which a loader would read
instead of ``model.safetensors``) would mix with the export. ``--force``
writes over such a folder and removes the other model's weight files
(``STALE_WEIGHTS``). Bad input is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from collections.abc import Sequence

import numpy as np
import orbax.checkpoint as ocp

from ntp_jax.data.dataset import TOKENIZER_FILE
from ntp_jax.errors import ConfigError
from ntp_jax.interop.hf_llama import WEIGHTS  # the weights file an export writes
from ntp_jax.interop.hf_tokenizer import write_hf_tokenizer
from ntp_jax.state.checkpoint import STATE, CheckpointError, one_line, quiet_late_reads
from ntp_jax.state.placement import Path, nest
from ntp_jax.training.stored_run import StoredRun, open_stored_run

USAGE_ERROR = 2  # bad input, as train.py
# Weight files of another model a Hugging Face loader reads before (or besides) WEIGHTS.
STALE_WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                 "pytorch_model*.bin.index.json")


def check_out(out: str, force: bool = False) -> list[str]:
  """Whether the export may write into ``out``; returns the stale weight files (names in
  ``out``) that ``--force`` removes first.

  Raises:
    ConfigError: naming ``--out``: it is a file, or a folder that is not empty (without
      ``force``), or one that cannot be listed.
  """
  if os.path.exists(out) and not os.path.isdir(out):
    raise ConfigError(f"--out: {out} is a file, not a folder; name a new or empty folder")
  if not os.path.isdir(out):
    return []
  try:
    names = sorted(os.listdir(out))
  except OSError as err:
    raise ConfigError(f"--out: cannot list {out} ({err.strerror})") from None
  if names and not force:
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    raise ConfigError(f"--out: {out} is not empty ({shown}); name a new or empty folder, or "
                      "pass --force to write over it (removing the weight files of any other "
                      "model there)")
  return [n for n in names if n != WEIGHTS and os.path.isfile(os.path.join(out, n))
          and any(fnmatch.fnmatch(n, pattern) for pattern in STALE_WEIGHTS)]


def read_params_on_host(run: StoredRun) -> dict[Path, np.ndarray]:
  """``path -> numpy array`` of every ``params`` leaf of the stored step (paths keep
  ``params``), each of its stored shape and dtype (``run.param_shapes``).

  Raises:
    CheckpointError: unreadable data, naming the step folder.
  """
  shapes = run.param_shapes
  item = nest({p: np.zeros((0,), np.float32) for p in shapes})
  restore_args = nest({p: ocp.RestoreArgs(restore_type=np.ndarray) for p in shapes})
  where = os.path.join(run.step_dir, STATE)
  try:
    with ocp.PyTreeCheckpointer() as reader:
      restored = reader.restore(where, args=ocp.args.PyTreeRestore(
          item=item, restore_args=restore_args, partial_restore=True))
  except Exception as err:  # orbax wraps OS and tensorstore errors in several types
    quiet_late_reads()
    raise CheckpointError(f"checkpoint {run.step_dir}: cannot read its parameters "
                          f"({one_line(err)})") from None
  out = {}
  for path, (shape, _) in shapes.items():
    value = restored
    for key in path:
      value = value[key]
    out[path] = np.asarray(value)
    if out[path].shape != shape:
      raise CheckpointError(f"checkpoint {run.step_dir}: {'/'.join(path)} read "
                            f"as {out[path].shape}, stored as {shape}")
  return out


def export_checkpoint(directory: str, out: str, step: int | None = None, *, force: bool = False,
                      log=lambda line: print(f"export_hf: {line}", file=sys.stderr)) -> int:
  """Write step ``step`` (default: the newest complete one) of ``directory`` to ``out``,
  a new or empty folder (or any folder with ``force``: see ``check_out``).

  ``directory`` is a run's checkpoints folder (or its workdir, or one step
  folder: ``ntp_jax.training.stored_run.open_stored_run``). The run's tokenizer
  goes with the weights (``directory/tokenizer.json``, the trainer's copy); a
  run without one (``.bin`` tokens, or older than that copy) gets one warning
  line through ``log`` and a folder without a tokenizer.

  Returns:
    The step written.

  Raises:
    ConfigError: one line naming ``--checkpoint`` or ``--step`` (no folder,
      no complete checkpoint, no such step), or the checkpoint's config
      field or parameter that does not fit the model (a run trained from
      ``model.init_from="hf:FOLDER"`` reads that folder's ``config.json``
      again for its shape), or a model without a Hugging Face export; naming
      ``--out`` when it is a file, a folder not empty (without ``force``), or
      cannot be written.
  """
  run = open_stored_run(directory, step, field="--checkpoint")
  model = run.model_spec()  # the model its config names
  if model.export_hf is None:
    raise CheckpointError(f"checkpoint {run.step_dir}: its model ({run.factory}) has no "
                          "Hugging Face export")
  stale = check_out(out, force)  # before the parameters are read: that takes a while
  params = read_params_on_host(run)
  seq_len = run.seq_len  # None in a config without it: no max_position_embeddings
  try:
    for name in stale:
      os.remove(os.path.join(out, name))
    if stale:
      log(f"--force: removed {', '.join(stale)} from {out} (another model's weights)")
    model.export_hf(params, out, max_position_embeddings=seq_len)
    if run.tokenizer_file is not None:
      eot_id = write_hf_tokenizer(run.tokenizer_file, out, model_max_length=seq_len)
      _set_token_ids(os.path.join(out, "config.json"), eot_id)
  except OSError as err:
    raise ConfigError(f"--out: cannot write {err.filename or out} "
                      f"({err.strerror or err})") from None
  if run.tokenizer_file is None:
    log(f"warning: --checkpoint: {run.directory} holds no {TOKENIZER_FILE} (a run on .bin "
        f"tokens, or one older than that copy): {out} has no tokenizer")
  return run.step


def _set_token_ids(config_json: str, eot_id: int) -> None:
  """``bos_token_id`` and ``eos_token_id`` of ``config.json``: the end-of-text separator
  (without them transformers' Llama defaults, 1 and 2, would mean other tokens)."""
  if not os.path.isfile(config_json):
    return
  with open(config_json, encoding="utf-8") as f:
    config = json.load(f)
  config.update(bos_token_id=eot_id, eos_token_id=eot_id)
  with open(config_json, "w", encoding="utf-8") as f:
    json.dump(config, f, indent=2)
    f.write("\n")


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m ntp_jax.interop.export_hf",
      description="Write a checkpoint's parameters as a Hugging Face Llama folder.")
  parser.add_argument("--checkpoint", required=True,
                      help="the run's checkpoints folder (or its workdir, or one step folder)")
  parser.add_argument("--step", type=int, default=None,
                      help="step to export (default: the newest complete one)")
  parser.add_argument("--out", required=True,
                      help="a new or empty folder for config.json, model.safetensors and the "
                           "tokenizer")
  parser.add_argument("--force", action="store_true",
                      help="write into a folder that is not empty, removing any other model's "
                           "weight files there")
  args = parser.parse_args(argv)
  try:
    step = export_checkpoint(args.checkpoint, args.out, args.step, force=args.force)
  except ConfigError as err:
    print(f"export_hf: {err}", file=sys.stderr)
    return USAGE_ERROR
  print(f"wrote step {step} of {args.checkpoint} to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
