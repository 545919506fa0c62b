"""Where data comes from: stdlib corpus, user text, and the error cases."""

import ast
import os
import pathlib

import numpy as np
import pytest

import ntp_jax.data
from ntp_jax.data import DataError, corpus, make_dataset


def build(path, tmp_path, **overrides):
  settings = dict(vocab_size=300, seq_len=8, cache_dir=str(tmp_path / "work"),
                  seed=0)
  settings.update(overrides)
  return make_dataset(path, **settings)


def raise_message(path, tmp_path, **overrides):
  with pytest.raises(DataError) as error:
    build(path, tmp_path, **overrides)
  message = str(error.value)
  assert "\n" not in message
  return message


def test_stdlib_corpus_is_sorted_library_source():
  source = corpus.stdlib_source()
  assert source.kind == "stdlib"
  assert list(source.files) == sorted(source.files)
  assert all(f.endswith(".py") for f in source.files)
  skipped = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
  for f in source.files:
    assert not skipped.intersection(pathlib.Path(f).parts), f


def test_stdlib_corpus_is_cut_to_the_byte_budget():
  source = corpus.stdlib_source()
  docs = corpus.read_documents(source.files, max_bytes=50_000)
  assert docs.num_bytes == 50_000
  assert docs.truncated
  assert sum(len(t.encode()) for t in docs.texts) >= 50_000 - 4 * len(
      docs.texts)  # only U+FFFD substitutions at a cut may change the count


@pytest.mark.parametrize("budget, kept, truncated", [
    (None, 30, False), (30, 30, False), (25, 25, True), (20, 20, True),
])
def test_byte_budget_is_exact(tmp_path, budget, kept, truncated):
  files = []
  for name in "abc":
    (tmp_path / name).write_text(name * 10)
    files.append(str(tmp_path / name))
  docs = corpus.read_documents(tuple(files), max_bytes=budget)
  assert docs.num_bytes == kept
  assert "".join(docs.texts) == ("a" * 10 + "b" * 10 + "c" * 10)[:kept]
  assert docs.truncated == truncated


def test_empty_path_means_stdlib(tmp_path):
  for path in (None, ""):
    ds = build(path, tmp_path, max_corpus_bytes=20_000)
    assert "stdlib" in ds.describe()


def test_text_folder_is_recursive_and_skips_binary_and_hidden(tmp_path):
  data = tmp_path / "data"
  (data / "sub").mkdir(parents=True)
  (data / "a.txt").write_text("alpha " * 50)
  (data / "sub" / "b.md").write_text("beta " * 50)
  (data / "blob.dat").write_bytes(b"\x00\x01binary" * 20)
  (data / ".hidden").write_text("secret " * 50)
  ds = build(str(data), tmp_path)
  assert ds.info.num_docs == 2
  assert ds.info.num_files == 3  # the binary file was opened, then skipped
  text = ds.tokenizer.decode(ds.batch(0, ds.num_sequences).ravel().tolist())
  assert "alpha" in text and "beta" in text
  assert "binary" not in text and "secret" not in text


def test_single_text_file_and_recursive_glob(tmp_path):
  (tmp_path / "d" / "e").mkdir(parents=True)
  (tmp_path / "d" / "e" / "deep.txt").write_text("deep text " * 40)
  (tmp_path / "d" / "top.txt").write_text("top text " * 40)
  (tmp_path / "d" / "skip.log").write_text("log text " * 40)
  assert build(str(tmp_path / "d" / "top.txt"), tmp_path).info.num_docs == 1
  ds = build(str(tmp_path / "d" / "**" / "*.txt"), tmp_path)
  assert ds.info.num_docs == 2


def test_missing_path(tmp_path):
  message = raise_message(str(tmp_path / "nope.txt"), tmp_path)
  assert message.startswith("data.path: no such file or folder")


def test_glob_without_match(tmp_path):
  message = raise_message(str(tmp_path / "*.txt"), tmp_path)
  assert message.startswith("data.path: no file matches")


def test_empty_file(tmp_path):
  (tmp_path / "empty.txt").write_text("")
  message = raise_message(str(tmp_path / "empty.txt"), tmp_path)
  assert message.startswith("data.path:")
  assert "empty" in message


def test_empty_folder(tmp_path):
  (tmp_path / "nothing").mkdir()
  message = raise_message(str(tmp_path / "nothing"), tmp_path)
  assert message.startswith("data.path: folder")


def test_only_binary_files(tmp_path):
  (tmp_path / "x.dat").write_bytes(bytes(range(256)))
  message = raise_message(str(tmp_path / "x.dat"), tmp_path)
  assert message.startswith("data.path:")
  assert "binary" in message


def test_too_few_tokens_for_one_sequence(tmp_path):
  (tmp_path / "short.txt").write_text("hi")
  message = raise_message(str(tmp_path / "short.txt"), tmp_path, seq_len=64)
  assert message.startswith("data.path:")
  assert "fewer than one sequence" in message


@pytest.mark.parametrize("overrides, field", [
    ({"seq_len": 0}, "train.seq_len"),
    ({"seed": -1}, "train.seed"),
    ({"vocab_size": 2.5}, "model.vocab_size"),
    ({"max_corpus_bytes": 0}, "data.max_corpus_bytes"),
    ({"val_fraction": 1.0}, "data.val_fraction"),
])
def test_bad_settings_name_their_field(tmp_path, overrides, field):
  message = raise_message(None, tmp_path, **overrides)
  assert message.startswith(field + ":")


def test_validation_fraction_that_leaves_no_training(tmp_path):
  one_sequence = tmp_path / "one.bin"
  np.arange(9, dtype="<u2").tofile(one_sequence)
  message = raise_message(str(one_sequence), tmp_path, seq_len=8,
                          val_fraction=0.5)
  assert message.startswith("data.val_fraction:")


def test_data_package_does_not_import_jax():
  package_dir = pathlib.Path(ntp_jax.data.__file__).parent
  for source_file in package_dir.glob("*.py"):
    tree = ast.parse(source_file.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        names = [node.module or ""]
      else:
        continue
      for name in names:
        assert name.split(".")[0] not in ("jax", "flax", "optax"), (
            f"{os.path.basename(source_file)} imports {name}")
