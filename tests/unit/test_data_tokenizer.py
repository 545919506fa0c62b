"""The byte-level BPE tokenizer: round trip, vocabulary, determinism."""

import numpy as np
import pytest

from ntp_jax.data import END_OF_TEXT, DataError, corpus, make_dataset
from ntp_jax.data import tokenizer as tokenizer_lib

VOCAB_SIZE = 512


@pytest.fixture(scope="module")
def stdlib_texts():
  source = corpus.stdlib_source()
  return corpus.read_documents(source.files, max_bytes=200_000).texts


@pytest.fixture(scope="module")
def trained(stdlib_texts):
  return tokenizer_lib.train_bpe_tokenizer(stdlib_texts, VOCAB_SIZE)


@pytest.mark.parametrize("text", [
    "def f(x):\n    return x + 1\n",
    "  leading spaces, trailing tab\t\n\n\nblank lines",
    "Unicode: naïve café, Ελληνικά, 日本語, emoji 🙂, NUL-free \u200b",
    "a literal " + END_OF_TEXT + " inside a document",
    "\r\nwindows\r\nline ends\r\n",
    "",
])
def test_decode_inverts_encode(trained, text):
  ids = trained.encode(text).ids
  assert trained.decode(ids) == text


def test_literal_separator_in_text_is_not_the_separator(trained):
  separator_id = tokenizer_lib.end_of_text_id(trained)
  assert separator_id not in trained.encode("x " + END_OF_TEXT).ids


def test_vocabulary_size_and_separator(trained):
  assert trained.get_vocab_size() == VOCAB_SIZE
  assert tokenizer_lib.end_of_text_id(trained) == 0


def test_training_is_deterministic(stdlib_texts, trained):
  again = tokenizer_lib.train_bpe_tokenizer(stdlib_texts, VOCAB_SIZE)
  assert again.to_str() == trained.to_str()


def test_saved_tokenizer_encodes_like_the_trained_one(trained, tmp_path,
                                                      stdlib_texts):
  path = str(tmp_path / "tokenizer.json")
  trained.save(path)
  loaded = tokenizer_lib.load_tokenizer(path)
  sample = stdlib_texts[0][:5000] + END_OF_TEXT
  assert loaded.encode(sample).ids == trained.encode(sample).ids


def test_dataset_stream_decodes_to_the_corpus(tmp_path):
  docs = ["first document\n", "second: ünïcödé\n", "third"]
  for i, text in enumerate(docs):
    (tmp_path / f"doc{i}.txt").write_text(text, encoding="utf-8")
  ds = make_dataset(str(tmp_path / "*.txt"), vocab_size=300, seq_len=3,
                    cache_dir=str(tmp_path / "work"), seed=0)
  assert ds.vocab_size == 300
  assert ds.tokenizer.get_vocab_size() <= 300
  shuffled = ds.batch(0, ds.num_sequences)  # the whole first epoch
  in_stream_order = shuffled[np.argsort(ds.epoch_order(0))]
  stream = in_stream_order.reshape(-1).tolist()
  decoded = ds.tokenizer.decode(stream, skip_special_tokens=False)
  full = END_OF_TEXT.join(docs) + END_OF_TEXT
  assert full.startswith(decoded)
  assert len(stream) == ds.num_tokens - ds.num_tokens % 4


def test_vocabulary_too_small_for_bytes(tmp_path):
  with pytest.raises(DataError, match=r"^model\.vocab_size: 100 is too small"):
    make_dataset(None, vocab_size=100, seq_len=8, cache_dir=str(tmp_path),
                 seed=0, max_corpus_bytes=10_000)
