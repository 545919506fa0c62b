"""``train.py`` whose process ``P`` kills itself (SIGKILL) after step ``S`` (tests only).

  NTP_JAX_DIE_AFTER=P:S python tests/programs/train_then_die.py --config ... (train.py's flags)

A lost host at a known point of the run: the step is complete everywhere (its
sync is shared), and a peer already waits at the next step's start, so the
survivors meet the loss there (``processes.arrival``). Run by
tests/system/test_multiprocess_recovery.py.
"""

import functools
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
from absl import app  # noqa: E402

import ntp_jax.training.trainer as trainer  # noqa: E402
import train  # noqa: E402
from ntp_jax.processes.arrival import arrival_key  # noqa: E402
from ntp_jax.training.hooks import Hook  # noqa: E402


class DieAfter(Hook):
  def __init__(self, process: int, step: int):
    self.process, self.step = process, step

  def on_step(self, info) -> None:
    if info.step == self.step and jax.process_index() == self.process:
      # Once a peer waits at the next step's start: no collective of this step is still
      # running there (a kill inside one cannot be survived on gloo; docs/multihost.md).
      from jax._src import distributed as jax_distributed  # the coordination service's client
      peer = 1 if self.process == 0 else 0  # epoch 0: no process lost before
      key = arrival_key(0, self.step + 1, peer, "start")
      jax_distributed.global_state.client.blocking_key_value_get(key, 60_000)
      os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
  process, step = map(int, os.environ["NTP_JAX_DIE_AFTER"].split(":"))
  trainer.train = functools.partial(trainer.train, hooks=[DieAfter(process, step)])
  app.run(train.main, flags_parser=train.parse_flags)
