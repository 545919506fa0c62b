"""The workdir cache: reuse, rebuild on changed inputs or damaged entries."""

import os

import numpy as np
import pytest

from ntp_jax.data import DataError, make_dataset
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


def truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def flip_one_byte(path):
  with open(path, "rb") as f:
    data = bytearray(f.read())
  data[len(data) // 2] ^= 0x01
  with open(path, "wb") as f:
    f.write(data)


def overwrite(text):
  def damage(path):
    with open(path, "w") as f:
      f.write(text)
  return damage


@pytest.mark.parametrize("name, damage", [
    ("tokens.npy", truncate),
    ("tokens.npy", flip_one_byte),
    ("tokens.npy", os.remove),
    ("tokenizer.json", overwrite('{"version": ')),
    ("tokenizer.json", flip_one_byte),
    ("meta.json", overwrite("")),
    ("meta.json", overwrite("{}")),
])
def test_damaged_entry_is_rebuilt_with_one_warning(tmp_path, capsys, name,
                                                   damage):
  folder = corpus_folder(tmp_path)
  fresh = build(folder, tmp_path)
  # Copied before the damage: `fresh` memory-maps the file being damaged.
  expected = fresh.sequences(0, fresh.num_sequences)
  entry = os.path.dirname(fresh.tokenizer_path)
  damage(os.path.join(entry, name))
  capsys.readouterr()

  rebuilt = build(folder, tmp_path)
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1, lines
  assert entry in lines[0] and "damaged" in lines[0]
  assert not rebuilt.from_cache
  assert rebuilt.num_tokens == fresh.num_tokens
  np.testing.assert_array_equal(
      rebuilt.sequences(0, rebuilt.num_sequences), expected)

  again = build(folder, tmp_path)
  assert again.from_cache
  assert capsys.readouterr().err == ""
  assert os.listdir(tmp_path / "work" / "data") == [os.path.basename(entry)]


def test_damaged_token_file_scan_is_redone(tmp_path, capsys):
  path = tmp_path / "train.bin"
  tokens = np.arange(200, dtype="<u2")
  tokens.tofile(path)
  first = build(str(path), tmp_path, vocab_size=512)
  (entry,) = (tmp_path / "work" / "data").iterdir()
  (entry / "meta.json").write_text("")
  capsys.readouterr()
  again = build(str(path), tmp_path, vocab_size=512)
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and str(entry) in lines[0]
  assert not again.from_cache
  np.testing.assert_array_equal(again.batch(0, 11), first.batch(0, 11))
  # The redone scan still guards the vocabulary.
  with pytest.raises(DataError, match=r"^model\.vocab_size: 199, .*token id 199"):
    build(str(path), tmp_path, vocab_size=199)


def test_entry_that_never_reads_back_is_a_clear_error(tmp_path, monkeypatch,
                                                      capsys):
  def broken(path):
    raise Exception("unexpected end of file")  # as tokenizers reports it

  monkeypatch.setattr(tokenizer_lib, "load_tokenizer", broken)
  with pytest.raises(DataError, match=r"^workdir: .*damaged after rebuild"):
    build(corpus_folder(tmp_path), tmp_path)
  assert "unexpected end of file" in capsys.readouterr().err
