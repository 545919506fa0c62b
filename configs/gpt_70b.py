"""Llama-3-70B shapes (arXiv:2407.21783, Table 3): 7.06e10 parameters, on 4 x 8 GPUs.

Parameters in bfloat16 on every device, and the optimizer state sharded
over the 4 replicas of each peer group (``train.optimizer_sharding=zero1``):
float32 master weights and Adam moments, a quarter per core device. Its dry
run (``python train.py --config configs/gpt_70b.py --config.dry_run=True``)
compares this with the replicated optimizer and zero2, healthy and with one
failed slot, against 80 GiB per device, every program compiled at full depth:
none fits on 4 x 8 at any DP yet (docs/scale.md).
"""

from configs import base


def get_config():
  c = base.get_config()
  c.workdir = "runs/gpt_70b"
  c.model.vocab_size = 128256
  c.model.d_model = 8192
  c.model.n_layers = 80
  c.model.n_heads = 64
  c.model.n_kv_heads = 8
  c.model.head_dim = 128
  c.model.d_ff = 28672
  c.model.ffn_granularity = 256  # 28672 = 112 x 256: even on 8 and on 7 slots
  c.model.rope_theta = 500_000.0
  c.model.dtype = "bfloat16"  # compute
  # Storage on every device; zero1 keeps float32 master weights and moments in its pieces
  c.model.param_dtype = "bfloat16"
  c.model.remat = "full"
  c.mesh.tp = 8
  c.mesh.dp = 4
  c.train.batch_size = 16
  c.train.microbatches = 4  # one 8,192-token sequence per micro-batch
  c.train.seq_len = 8192
  c.train.lr = 1.5e-4
  c.train.warmup_steps = 2000
  c.train.steps = 100_000
  c.train.optimizer_sharding = "zero1"
  c.data.max_corpus_bytes = 64_000_000
  return c
