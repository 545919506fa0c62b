"""Training data: corpus, BPE tokenizer, packing into seeded batches.

numpy and `tokenizers` only (no JAX), so data preparation runs anywhere.

  ds = make_dataset(path=None, vocab_size=8192, seq_len=256,
                    cache_dir="workdir", seed=0)
  tokens = ds.sequences(cursor, count)  # int32 [count, seq_len + 1]
  cursor += count                       # the count may change per step
  tokens = ds.batch(step, batch_size)   # = ds.sequences(step * bs, bs)

Every user-facing failure is a `DataError`: one line naming the config field.
"""

from ntp_jax.data.dataset import make_dataset
from ntp_jax.data.errors import DataError
from ntp_jax.data.packed_dataset import CorpusInfo, PackedDataset
from ntp_jax.data.tokenizer import END_OF_TEXT

__all__ = [
    "CorpusInfo",
    "DataError",
    "END_OF_TEXT",
    "PackedDataset",
    "make_dataset",
]
