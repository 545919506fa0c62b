"""Llama-style 1.1B (1.107e9 parameters, 8 KV heads): single-GPU throughput (bench/gpu.py)."""

from configs import base


def get_config():
  c = base.get_config()
  c.workdir = "runs/gpt_1b"
  c.model.vocab_size = 32768
  c.model.d_model = 2048
  c.model.n_layers = 16
  c.model.n_heads = 32
  c.model.n_kv_heads = 8
  c.model.head_dim = 64
  c.model.d_ff = 8192
  # 8192 = 2**13: no granularity splits it evenly on 7 slots; 1 pads the least there.
  c.model.ffn_granularity = 1
  c.model.dtype = "bfloat16"  # compute; parameters and Adam moments stay float32
  c.model.remat = "none"  # bench/gpu.py --remat full when the activations do not fit
  c.train.batch_size = 8
  c.train.seq_len = 2048
  c.train.lr = 3e-4
  c.train.warmup_steps = 200
  return c
