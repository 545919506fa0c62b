"""Micro GPT (0.17M parameters): gpt_tiny narrowed, for smoke tests and the test suite.

As in gpt_tiny, a replica at TP degree 3, 5, 6 or 7 splits the vocabulary (512) and the 8 heads
unevenly; at 2, 4 and 8 everything divides. A step of 16 x 32 tokens takes about a tenth of a
second on 2 CPU cores, so a run's time is mostly its compilation. Every run follows one
learning-rate curve (20 steps, ``train.schedule_steps``): the curve's length is a constant of
the compiled step, so runs of different lengths on the same plan share their programs through
the compilation cache, and a shorter run is a prefix of a longer one.
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
  c.train.schedule_steps = 20
  return c
