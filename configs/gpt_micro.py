"""Micro GPT (0.17M parameters): gpt_tiny narrowed, for smoke tests and the test suite.

Every TP degree up to 8 still splits something unevenly (the vocabulary of 512 at degree 3, 5, 6
and 7; 8 heads at degree 3). A step of 16 x 32 tokens takes about a tenth of a second on 2 CPU
cores, so a run's time is mostly its compilation.
"""

from configs import gpt_tiny


def get_config():
  c = gpt_tiny.get_config()
  c.workdir = "runs/gpt_micro"
  c.model.vocab_size = 512
  c.model.d_model = 64
  c.model.head_dim = 8
  c.model.d_ff = 192
  c.train.seq_len = 32
  return c
