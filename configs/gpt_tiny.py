"""Tiny GPT (0.95M parameters): a training step well under a second on 2 CPU cores."""

from configs import base


def get_config():
  c = base.get_config()
  c.workdir = "runs/gpt_tiny"
  c.model.vocab_size = 2048
  c.model.d_model = 128
  c.model.n_layers = 2
  c.model.n_heads = 8
  c.model.n_kv_heads = 8
  c.model.head_dim = 16
  c.model.d_ff = 384
  c.train.steps = 150
  c.train.batch_size = 16
  c.train.seq_len = 64
  c.train.lr = 3e-3
  c.data.max_corpus_bytes = 2_000_000
  return c
