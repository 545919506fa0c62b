"""Token sets (``ntp_jax.data.token_set``): text encoded by ``build_tokens`` into ``.bin``
shards whose manifest names the dtype; a vocabulary past 65,535 ids round-trips through
uint32, and ids that do not fit are refused in one line."""

import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from ntp_jax.data import DataError, make_dataset
from ntp_jax.data.build_tokens import build_token_set, main

VOCAB = 70_000  # past uint16


@pytest.fixture
def corpus(tmp_path):
  """A word-level tokenizer of 70,000 ids (0: end of text) and two one-document files."""
  words = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
  tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(tmp_path / "tokenizer.json"))
  text = tmp_path / "text"
  text.mkdir()
  (text / "a.txt").write_text("w69999 w65536 w2")
  (text / "b.txt").write_text("w300 w65537")
  return str(text), str(tmp_path / "tokenizer.json")


def dataset(path, tmp_path, vocab_size=VOCAB, **kwargs):
  return make_dataset(path, vocab_size=vocab_size, seq_len=1, cache_dir=str(tmp_path / "work"),
                      seed=0, **kwargs)


def test_a_large_vocabulary_round_trips_through_uint32_shards(corpus, tmp_path):
  text, tokenizer_path = corpus
  out = str(tmp_path / "tokens")
  lines = []
  built = build_token_set(text, tokenizer_path, out, shard_tokens=3, log=lines.append)
  # Each document is followed by the separator (id 0); a shard ends at a document's end.
  assert built.dtype == "uint32" and [n for _, n in built.shards] == [4, 3]
  first = np.fromfile(os.path.join(out, "tokens-00000.bin"), dtype="<u4")
  assert first.tolist() == [69999, 65536, 2, 0]
  manifest = json.loads(open(os.path.join(out, "tokens.json")).read())
  assert manifest["dtype"] == "uint32" and manifest["separator_id"] == 0
  assert lines[-1].endswith(f"uint32, separator <|endoftext|> (id 0); train with "
                            f"--config.data.path={out}")

  # The reader takes the dtype from the manifest. Sequences never span shards: shard 0
  # gives 2 rows of 2 tokens, shard 1 one (its last token dropped); the last is held out.
  ds = dataset(out, tmp_path, val_fraction=0.34)
  rows = ds.batch(0, 2)[np.argsort(ds.epoch_order(0))]
  assert rows.tolist() == [[69999, 65536], [2, 0]]
  assert ds.validation.batch(0, 1).tolist() == [[300, 65537]]
  assert ds.num_tokens == 7 and ds.tokenizer_path == os.path.join(out, "tokenizer.json")
  assert ds.tokenizer.decode([69999, 65536]) == "w69999 w65536"
  # One shard alone is read with its set's dtype too.
  assert dataset(os.path.join(out, "tokens-00001.bin"), tmp_path).num_tokens == 3


def test_ids_that_do_not_fit_are_one_line_errors(corpus, tmp_path):
  text, tokenizer_path = corpus
  with pytest.raises(DataError) as too_narrow:
    build_token_set(text, tokenizer_path, str(tmp_path / "narrow"), dtype="uint16")
  assert str(too_narrow.value) == (f"--dtype: uint16 holds ids below 65,536, but "
                                   f"{tokenizer_path} has 70,000 ids; use uint32")
  out = str(tmp_path / "tokens")
  build_token_set(text, tokenizer_path, out, log=lambda _: None)
  with pytest.raises(DataError) as too_small:
    dataset(out, tmp_path, vocab_size=65_536)
  message = str(too_small.value)
  assert message.startswith("model.vocab_size: 65536, but token file")
  assert "holds token id 69999" in message and "\n" not in message
  # A shard whose size disagrees with its manifest is named, not read short.
  with open(os.path.join(out, "tokens-00000.bin"), "ab") as shard:
    shard.write(np.zeros(1, "<u4").tobytes())
  with pytest.raises(DataError, match=r"^data\.path: token file .* holds 8 uint32 tokens, "
                                      r"its token set's manifest says 7"):
    dataset(out, tmp_path)


def test_the_command_refuses_a_folder_that_holds_a_set(corpus, tmp_path, capsys):
  text, tokenizer_path = corpus
  out = str(tmp_path / "tokens")
  assert main([text, "--tokenizer", tokenizer_path, "--out", out]) == 0
  assert main([text, "--tokenizer", tokenizer_path, "--out", out]) == 2
  assert capsys.readouterr().err.strip() == (
      f"build_tokens: --out: {out} already holds a token set or .bin files; give a new folder")


def test_a_broken_tokenizer_copy_names_data_path(corpus, tmp_path):
  text, tokenizer_path = corpus
  out = str(tmp_path / "tokens")
  build_token_set(text, tokenizer_path, out, log=lambda _: None)
  with open(os.path.join(out, "tokenizer.json"), "w") as f:
    f.write("not json")
  with pytest.raises(DataError, match=r"^data\.path: token set .*: cannot read .*tokenizer"):
    dataset(out, tmp_path)
