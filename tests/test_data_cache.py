"""The workdir cache: reuse on a second call, rebuild when inputs change."""

import os

import numpy as np
import pytest

from ntp_jax.data import make_dataset
from ntp_jax.data import tokenizer as tokenizer_lib


def corpus_folder(tmp_path):
  folder = tmp_path / "corpus"
  folder.mkdir()
  for i in range(3):
    (folder / f"part{i}.txt").write_text(f"document {i}: " + "words " * 200)
  return folder


def build(folder, tmp_path, vocab_size=320):
  return make_dataset(str(folder), vocab_size=vocab_size, seq_len=16,
                      cache_dir=str(tmp_path / "work"), seed=3)


def cached_files(ds):
  entry = os.path.dirname(ds.tokenizer_path)
  return {name: os.stat(os.path.join(entry, name)).st_mtime_ns
          for name in os.listdir(entry)}


def test_second_call_reuses_tokenizer_and_tokens(tmp_path, monkeypatch):
  folder = corpus_folder(tmp_path)
  first = build(folder, tmp_path)
  assert not first.from_cache
  assert set(cached_files(first)) == {"tokenizer.json", "tokens.npy",
                                      "meta.json"}
  before = cached_files(first)

  def no_training(*args, **kwargs):
    raise AssertionError("the tokenizer was trained again")

  monkeypatch.setattr(tokenizer_lib, "train_bpe_tokenizer", no_training)
  second = build(folder, tmp_path)
  assert second.from_cache
  assert "reused from cache" in second.describe()
  assert cached_files(second) == before
  assert second.tokenizer_path == first.tokenizer_path
  np.testing.assert_array_equal(second.batch(2, 5), first.batch(2, 5))


def test_changed_input_or_vocabulary_builds_a_new_entry(tmp_path):
  folder = corpus_folder(tmp_path)
  first = build(folder, tmp_path)
  other_vocab = build(folder, tmp_path, vocab_size=330)
  assert not other_vocab.from_cache
  assert other_vocab.tokenizer_path != first.tokenizer_path

  (folder / "part1.txt").write_text("edited " * 300)
  edited = build(folder, tmp_path)
  assert not edited.from_cache
  assert edited.tokenizer_path != first.tokenizer_path


def test_no_staging_folders_left_behind(tmp_path):
  build(corpus_folder(tmp_path), tmp_path)
  names = os.listdir(tmp_path / "work" / "data")
  assert len(names) == 1 and ".tmp" not in names[0]


def test_failed_build_leaves_no_entry(tmp_path):
  (tmp_path / "empty.txt").write_text("")
  with pytest.raises(ValueError):
    make_dataset(str(tmp_path / "empty.txt"), vocab_size=300, seq_len=4,
                 cache_dir=str(tmp_path / "work"), seed=0)
  assert os.listdir(tmp_path / "work" / "data") == []
