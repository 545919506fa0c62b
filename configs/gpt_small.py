"""Small GPT (27M parameters, 8 KV heads): for benchmarks on simulated devices."""

from configs import base


def get_config():
  c = base.get_config()
  c.workdir = "runs/gpt_small"
  c.model.vocab_size = 8192
  c.model.d_model = 512
  c.model.n_layers = 6
  c.model.n_heads = 16
  c.model.n_kv_heads = 8
  c.model.head_dim = 32
  c.model.d_ff = 1536
  c.train.batch_size = 16
  c.train.seq_len = 256
  c.train.lr = 1e-3
  return c
