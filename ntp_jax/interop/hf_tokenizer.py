"""The run's tokenizer in a Hugging Face folder, beside ``config.json`` and the weights.

Writes ``tokenizer.json`` (the ``tokenizers`` file the run encoded its text
with, as it is), ``tokenizer_config.json`` and ``special_tokens_map.json``,
the files ``transformers.AutoTokenizer`` reads for a fast tokenizer
(``PreTrainedTokenizerFast``). The special tokens are the project's
(``ntp_jax.data.tokenizer``): the end-of-text separator packed after every
document is the only one; it serves as end and, as in GPT-2, as beginning of
text; there is no unknown token (byte-level BPE) and no padding token.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tokenizers import Tokenizer

from ntp_jax.data.tokenizer import END_OF_TEXT_TOKENS, copy_file
from ntp_jax.errors import ConfigError

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


def write_hf_tokenizer(tokenizer_path: str, folder: str, *,
                       model_max_length: int | None = None) -> int:
  """Write the tokenizer files of a Hugging Face folder.

  Args:
    tokenizer_path: the run's ``tokenizers`` JSON file.
    folder: the Hugging Face folder (exists).
    model_max_length: ``tokenizer_config.json``'s longest input (the
      training sequence length, say); absent when None.

  Returns:
    The id of the end-of-text token (for ``config.json``'s ``eos_token_id``).

  Raises:
    ConfigError: the file does not read as a tokenizer or has none of
      ``END_OF_TEXT_TOKENS``, naming it.
  """
  try:
    tokenizer = Tokenizer.from_file(tokenizer_path)
  except Exception as err:  # tokenizers raises bare Exception
    raise ConfigError(f"{tokenizer_path}: not a tokenizers JSON file ({err})") from None
  eot = next((t for t in END_OF_TEXT_TOKENS if tokenizer.token_to_id(t) is not None), None)
  if eot is None:
    raise ConfigError(f"{tokenizer_path}: has none of the end-of-text tokens "
                      f"{', '.join(END_OF_TEXT_TOKENS)}")
  eot_id = tokenizer.token_to_id(eot)
  copy_file(tokenizer_path, os.path.join(folder, TOKENIZER))
  special = {"bos_token": eot, "eos_token": eot}
  config: dict[str, Any] = {
      "tokenizer_class": "PreTrainedTokenizerFast", **special, "unk_token": None,
      "pad_token": None, "add_bos_token": False, "add_eos_token": False,
      "clean_up_tokenization_spaces": False,
      "added_tokens_decoder": {str(eot_id): {"content": eot, "lstrip": False,
                                             "normalized": False, "rstrip": False,
                                             "single_word": False, "special": True}}}
  if model_max_length is not None:
    config["model_max_length"] = int(model_max_length)
  _write_json(os.path.join(folder, TOKENIZER_CONFIG), config)
  _write_json(os.path.join(folder, SPECIAL_TOKENS_MAP), special)
  return eot_id


def _write_json(path: str, value: Any) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=2)
    f.write("\n")
