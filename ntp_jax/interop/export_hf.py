"""``python -m ntp_jax.interop.export_hf --checkpoint DIR [--step N] --out FOLDER``.

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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import numpy as np
import orbax.checkpoint as ocp

from ntp_jax.data.dataset import TOKENIZER_FILE
from ntp_jax.errors import ConfigError
from ntp_jax.interop.hf_tokenizer import write_hf_tokenizer
from ntp_jax.state.checkpoint import STATE, CheckpointError
from ntp_jax.state.placement import Path, nest
from ntp_jax.training.stored_run import StoredRun, open_stored_run


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
    raise CheckpointError(f"checkpoint {run.step_dir}: cannot read its "
                          f"parameters ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
                          ) from None
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


def export_checkpoint(directory: str, out: str, step: int | None = None, *,
                      log=lambda line: print(f"export_hf: {line}", file=sys.stderr)) -> int:
  """Write step ``step`` (default: the newest complete one) of ``directory`` to ``out``.

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
      again for its shape), or a model without a Hugging Face export.
  """
  run = open_stored_run(directory, step, field="--checkpoint")
  model = run.model_spec()  # the model its config names
  if model.export_hf is None:
    raise CheckpointError(f"checkpoint {run.step_dir}: its model ({run.factory}) has no "
                          "Hugging Face export")
  params = read_params_on_host(run)
  seq_len = run.seq_len  # None in a config without it: no max_position_embeddings
  model.export_hf(params, out, max_position_embeddings=seq_len)
  if run.tokenizer_file is not None:
    eot_id = write_hf_tokenizer(run.tokenizer_file, out, model_max_length=seq_len)
    _set_token_ids(os.path.join(out, "config.json"), eot_id)
  else:
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
                      help="folder for config.json, model.safetensors and the tokenizer")
  args = parser.parse_args(argv)
  try:
    step = export_checkpoint(args.checkpoint, args.out, args.step)
  except ConfigError as err:
    print(f"export_hf: {err}", file=sys.stderr)
    return 1
  print(f"wrote step {step} of {args.checkpoint} to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
