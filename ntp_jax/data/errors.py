"""The one exception type of the data package and the config fields it names.

Every user-facing problem with the training data (a missing path, an empty
corpus, a token out of range) is reported as a `DataError` whose message is a
single line that starts with the name of the config field to fix, so the
trainer can print it instead of a traceback.
"""

# Config field named in messages, keyed by `make_dataset` argument. Kept in
# one place so the names follow the trainer's config if it renames a field.
FIELD_NAMES = {
    "path": "data.path",
    "vocab_size": "model.vocab_size",
    "seq_len": "train.seq_len",
    "seed": "train.seed",
    "max_corpus_bytes": "data.max_corpus_bytes",
    "val_fraction": "data.val_fraction",
    "cache_dir": "workdir",
    "batch_size": "train.batch_size",
    # The model's own tokenizer.json: set by model.init_from (a Hugging Face folder).
    "tokenizer_path": "model.init_from",
}


class DataError(ValueError):
  """Bad data input; the message is one line naming the config field."""

  def __init__(self, message: str):
    # Paths or OS messages may carry newlines; the contract is one line.
    super().__init__(" ".join(str(message).split()))


def field_error(argument: str, message: str) -> DataError:
  """Builds a `DataError` that starts with the config field of `argument`.

  Args:
    argument: the `make_dataset` argument at fault, e.g. "path".
    message: what is wrong and, where possible, how to fix it.

  Returns:
    A `DataError` reading "<field>: <message>".
  """
  return DataError(f"{FIELD_NAMES.get(argument, argument)}: {message}")
