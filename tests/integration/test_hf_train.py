"""Training from Hugging Face weights: ``model.init_from="hf:FOLDER"``.

The folder's ``tokenizer.json`` encodes the training text (``make_dataset``'s
``tokenizer_path``) and its tensors are the parameters a fresh run, and a
restart before the first checkpoint, begin from. With ``train.lr=0`` the
parameters after training are the file's, on an uneven plan (TP degree 3
over a vocabulary of 320 and 2 KV heads), and export gives them back.
"""

import filecmp
import importlib.util
import json
import os

import numpy as np
import pytest
from helpers import micro_config
from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.gpt import GPTConfig
from ntp_jax.data import DataError, make_dataset
from ntp_jax.errors import ConfigError
from ntp_jax.interop.export_hf import export_checkpoint
from ntp_jax.interop.hf_llama import names, read_hf_config
from ntp_jax.parallel.programs import logical_state
from ntp_jax.training.metrics import read_records
from ntp_jax.training.trainer import train

_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
_spec = importlib.util.spec_from_file_location(
    "make_hf_reference", os.path.join(_FIXTURES, "make_hf_reference.py"))
fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fixture)

SEPARATOR = "</s>"
TEXTS = ["the cat sat on the mat", "a dog ran in the fog and the sun", "the end of the story",
         "one two three four five six seven eight nine ten"]
MODEL_VOCAB = 320  # above the tokenizer's (at most 300): rows no token uses stay as the file's


def _tokenizer_file(path, vocab_size=300, special=SEPARATOR) -> str:
  """A byte-level BPE trained on ``TEXTS`` (``special`` is token 0), saved as ``path``."""
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[special],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  tokenizer.train_from_iterator(TEXTS, trainer)
  tokenizer.save(str(path))
  return str(path)


def test_make_dataset_encodes_with_the_given_tokenizer(tmp_path):
  tok = _tokenizer_file(tmp_path / "tokenizer.json")
  docs = {"a.txt": "the cat sat on a literal </s> mat\n" * 3, "b.txt": "ten dogs in the fog\n" * 3}
  (tmp_path / "text").mkdir()
  for name, text in docs.items():
    (tmp_path / "text" / name).write_text(text)
  kw = dict(path=str(tmp_path / "text"), vocab_size=512, seq_len=8,
            cache_dir=str(tmp_path / "work"), seed=0)
  ds = make_dataset(**kw, tokenizer_path=tok)

  given = Tokenizer.from_file(tok)
  given.encode_special_tokens = True  # a "</s>" in the text is text; packing places separators
  eos = given.token_to_id(SEPARATOR)
  expected = np.concatenate([np.r_[given.encode(t, add_special_tokens=False).ids, eos]
                             for t in docs.values()])
  entry = os.path.dirname(ds.tokenizer_path)
  tokens = np.load(os.path.join(entry, "tokens.npy"))
  np.testing.assert_array_equal(tokens, expected)
  assert np.sum(tokens == eos) == len(docs)
  first = list(tokens).index(eos)
  assert ds.tokenizer.decode(tokens[:first].tolist()) == docs["a.txt"]
  assert ds.tokenizer.get_vocab() == given.get_vocab()
  assert filecmp.cmp(ds.tokenizer_path, tok, shallow=False)  # the entry holds a copy
  assert not ds.from_cache
  origin, _, tokenizer_line = ds.describe().split("\n")
  assert origin.startswith("data: ") and "2 file(s), 2 docs" in origin
  assert tokenizer_line == (f"  tokenizer: {ds.tokenizer_path} ({given.get_vocab_size()} tokens, "
                            f"copy of {tok}), built")

  again = make_dataset(**kw, tokenizer_path=tok)
  assert again.from_cache and again.tokenizer_path == ds.tokenizer_path
  np.testing.assert_array_equal(again.sequences(0, 4), ds.sequences(0, 4))
  trained = make_dataset(**kw)  # a BPE of its own: another entry
  assert os.path.dirname(trained.tokenizer_path) != entry
  _tokenizer_file(tok, vocab_size=280)  # another file at the same path: another entry
  other = make_dataset(**kw, tokenizer_path=tok)
  assert not other.from_cache and os.path.dirname(other.tokenizer_path) != entry


def test_given_tokenizer_errors_name_the_field_and_file(tmp_path):
  tok = _tokenizer_file(tmp_path / "tokenizer.json")
  (tmp_path / "a.txt").write_text("the cat sat on the mat\n" * 10)
  kw = dict(path=str(tmp_path / "a.txt"), seq_len=8, cache_dir=str(tmp_path / "work"), seed=0)
  size = Tokenizer.from_file(tok).get_vocab_size()
  with pytest.raises(DataError, match=rf"^model\.vocab_size: 100 is fewer than the {size} token "
                     rf"ids of {tok};") as err:
    make_dataset(**kw, vocab_size=100, tokenizer_path=tok)
  assert "\n" not in str(err.value)
  no_eos = _tokenizer_file(tmp_path / "no_eos.json", special="<pad>")
  with pytest.raises(DataError, match=rf"^model\.init_from: {no_eos} has none of the "
                     "end-of-text tokens"):
    make_dataset(**kw, vocab_size=512, tokenizer_path=no_eos)
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(DataError, match=r"^model\.init_from: cannot read .*bad\.json"):
    make_dataset(**kw, vocab_size=512, tokenizer_path=str(tmp_path / "bad.json"))


def _expected_params(stored, cfg) -> dict:
  """Logical ``params`` path -> float32 array, from the file tensors (as ``hf_llama`` reads)."""
  out = {}
  for name in names(cfg):
    def one(hf, name=name):
      t = np.asarray(stored[hf], np.float32)
      return t.T if name.transposed else t
    out[("params",) + name.path] = (
        np.stack([one(name.hf.format(i=i)) for i in range(cfg.n_layers)]) if name.layered
        else one(name.hf))
  return out


def test_training_from_hf_weights_keeps_them_at_lr_zero(tmp_path):
  folder = str(tmp_path / "hf")
  stored = fixture.write_model(folder, "untied", vocab_size=MODEL_VOCAB)
  _tokenizer_file(os.path.join(folder, "tokenizer.json"))
  lines = []
  # Slot 2 fails before step 1: ntp.recovery="restart" with no checkpoint yet goes back to
  # the initial parameters, which must be the folder's again (not a random init).
  config = micro_config(tmp_path / "work", **{
      "model.init_from": f"hf:{folder}", "mesh.tp": 4, "ntp.failed": "1", "train.steps": 3,
      "train.lr": 0.0, "data.max_corpus_bytes": 50_000, "ntp.fail_at": "1@0:2",
      "ntp.recovery": "restart", "checkpoint.every": 10, "train.eval_every": 0})
  summary = train(config, log=lines.append)
  log = "\n".join(lines)

  cfg = GPTConfig(**read_hf_config(folder))
  assert [r.degree for r in summary.plan.replicas] == [2]
  state = logical_state(summary.programs)
  expected = _expected_params(stored, cfg)
  assert {p for p in state if p[0] == "params"} == set(expected)
  for path, want in expected.items():
    np.testing.assert_array_equal(np.asarray(state[path]), want, err_msg="/".join(path))

  assert log.count(f"parameters: from hf:{folder} (config.json: 2 layers, d_model 32,") == 2
  assert f"copy of {os.path.join(folder, 'tokenizer.json')}" in log  # the folder's tokenizer
  events = [r["event"] for r in read_records(summary.metrics_path) if "event" in r]
  assert events[0] == "start" and "resume" not in events

  out = str(tmp_path / "export")
  assert export_checkpoint(os.path.join(config.workdir, "checkpoints"), out) == 3
  exported = load_file(os.path.join(out, "model.safetensors"))
  assert set(exported) == set(stored)
  for name, tensor in stored.items():
    np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["vocab_size"] == MODEL_VOCAB


@pytest.mark.parametrize("init_from,message", [
    ("hg:/x", r"'hg:/x' is not '' \(random init\) or 'hf:/path/to/folder'"),
    ("hf:/no/such/folder", r"'hf:/no/such/folder': no folder '/no/such/folder'"),
])
def test_bad_init_from_is_a_one_line_error(tmp_path, init_from, message):
  config = micro_config(tmp_path, **{"model.init_from": init_from})
  with pytest.raises(ConfigError, match=rf"^model\.init_from: {message}") as err:
    train(config, log=lambda *_: None)
  assert "\n" not in str(err.value)


def test_the_tokenizer_travels_with_the_exported_weights(tmp_path):
  """Export writes the run's tokenizer, every file world-readable (as a plain new file); a run
  from the folder encodes with it and starts at the exported run's loss."""
  first = train(micro_config(tmp_path / "first", **{"train.steps": 30, "checkpoint.every": 30,
                                                    "train.schedule_steps": 0}),  # its own curve
                log=lambda *_: None)
  out = tmp_path / "hf"
  assert export_checkpoint(str(tmp_path / "first" / "checkpoints"), str(out)) == 30
  names_written = sorted(os.listdir(out))
  assert names_written == ["config.json", "model.safetensors", "special_tokens_map.json",
                           "tokenizer.json", "tokenizer_config.json"]
  (tmp_path / "plain").write_text("")
  plain_mode = os.stat(tmp_path / "plain").st_mode & 0o777
  for name in names_written:
    assert os.stat(out / name).st_mode & 0o777 == plain_mode, name
  tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
  text = "def main(argv):\n  return sorted(argv, key=len)  # ünïcode\n"
  assert tokenizer.decode(tokenizer.encode(text).ids) == text
  with open(out / "tokenizer_config.json") as f:
    tokenizer_config = json.load(f)
  eot = tokenizer.token_to_id("<|endoftext|>")
  assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
  assert tokenizer_config["eos_token"] == "<|endoftext|>" and tokenizer_config["unk_token"] is None
  assert tokenizer_config["added_tokens_decoder"][str(eot)]["special"]
  with open(out / "config.json") as f:
    assert json.load(f)["eos_token_id"] == eot

  lines = []
  again = train(micro_config(tmp_path / "again", **{"model.init_from": f"hf:{out}",
                                                   "train.steps": 2, "train.lr": 0.0}),
                log=lines.append)
  assert f"copy of {out / 'tokenizer.json'}" in "\n".join(lines)
  assert not [line for line in lines if line.startswith("warning")], lines
  last = float(np.mean(first.losses[-5:]))
  assert last < np.log(512) - 1.0
  assert abs(again.losses[0] - last) < 0.3, (again.losses, first.losses[-5:])


def test_a_folder_without_a_tokenizer_warns_in_one_line(tmp_path):
  folder = str(tmp_path / "hf")
  fixture.write_model(folder, "untied", vocab_size=MODEL_VOCAB)
  lines = []
  config = micro_config(tmp_path / "work", **{"model.init_from": f"hf:{folder}", "mesh.tp": 4})
  config.dry_run = True  # the warning comes before the data; nothing needs to run
  train(config, log=lines.append)
  warned = [line for line in lines if line.startswith("warning")]
  assert warned == [f"warning: model.init_from: hf:{folder} has no tokenizer.json; a 320-token "
                    "BPE tokenizer is trained on the data instead, whose ids are not the tokens "
                    "these weights learned"]
