"""Llama-3-8B shapes (arXiv:2407.21783, Table 3): 8.03e9 parameters, for GPU clusters."""

from configs import base


def get_config():
  c = base.get_config()
  c.workdir = "runs/gpt_8b"
  c.model.vocab_size = 128256
  c.model.d_model = 4096
  c.model.n_layers = 32
  c.model.n_heads = 32
  c.model.n_kv_heads = 8
  c.model.head_dim = 128
  c.model.d_ff = 14336
  c.model.ffn_granularity = 256  # 14336 = 56 x 256: even on 8 and on 7 slots
  c.model.rope_theta = 500_000.0
  c.model.dtype = "bfloat16"  # compute; parameters and Adam moments stay float32
  c.model.remat = "full"  # without it one step's activations need ~1 TB per device (dry run)
  c.train.batch_size = 8
  c.train.seq_len = 8192
  c.train.lr = 3e-4
  c.train.warmup_steps = 2000
  c.train.steps = 100_000
  c.data.max_corpus_bytes = 64_000_000
  return c
