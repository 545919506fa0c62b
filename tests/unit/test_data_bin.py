"""Pre-tokenized uint16 .bin token files (nanoGPT format)."""

import numpy as np
import pytest

from ntp_jax.data import DataError, make_dataset


def write_bin(path, tokens):
  np.asarray(tokens, dtype="<u2").tofile(path)
  return str(path)


def build(path, tmp_path, vocab_size=50304, seq_len=16, **kwargs):
  return make_dataset(path, vocab_size=vocab_size, seq_len=seq_len,
                      cache_dir=str(tmp_path / "work"), seed=0, **kwargs)


def test_bin_file_is_served_as_packed_sequences(tmp_path):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 50257, size=17 * 30 + 5)
  ds = build(write_bin(tmp_path / "train.bin", tokens), tmp_path)
  assert ds.tokenizer is None
  assert ds.tokenizer_path is None
  assert ds.num_tokens == tokens.size
  assert ds.num_sequences == 30
  assert ds.vocab_size == 50304
  batch = ds.batch(0, 30)
  assert batch.dtype == np.int32 and batch.shape == (30, 17)
  stream_order = batch[np.argsort(ds.epoch_order(0))]
  np.testing.assert_array_equal(stream_order.ravel(), tokens[:30 * 17])
  line = ds.describe()
  assert "train.bin" in line and "pre-tokenized" in line and len(line.splitlines()) == 3


def test_bin_file_as_the_only_glob_match(tmp_path):
  write_bin(tmp_path / "train.bin", np.arange(100))
  assert build(str(tmp_path / "tr*.bin"), tmp_path).num_tokens == 100


def test_token_at_or_above_vocab_size(tmp_path):
  path = write_bin(tmp_path / "big.bin", [1, 2, 3, 511, 512, 4] * 10)
  with pytest.raises(DataError) as error:
    build(path, tmp_path, vocab_size=512, seq_len=4)
  message = str(error.value)
  assert message.startswith("model.vocab_size: 512, but token file")
  assert "token id 512" in message and "\n" not in message
  # The same file passes with a vocabulary large enough (the cached scan of
  # the file is checked against each vocabulary size).
  assert build(path, tmp_path, vocab_size=513, seq_len=4).num_tokens == 60


@pytest.mark.parametrize("content, words", [
    (b"", "empty"),
    (b"\x01\x00\x02", "whole number"),
])
def test_malformed_bin_file(tmp_path, content, words):
  path = tmp_path / "bad.bin"
  path.write_bytes(content)
  with pytest.raises(DataError, match=r"^data\.path: .*" + words):
    build(str(path), tmp_path)


def test_several_bin_files_are_ambiguous(tmp_path):
  write_bin(tmp_path / "a.bin", np.arange(50))
  write_bin(tmp_path / "b.bin", np.arange(50))
  with pytest.raises(DataError, match=r"^data\.path: .*exactly one \.bin"):
    build(str(tmp_path / "*.bin"), tmp_path)
