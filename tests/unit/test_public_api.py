"""``import ntp_jax``: the public names resolve, and importing it starts no JAX."""

import subprocess
import sys

from helpers import ROOT, process_env

CHECK = """
import sys
import ntp_jax
assert "jax" not in sys.modules, "import ntp_jax imported jax"
import ntp_jax.training.config  # the package of the same name as the function: no clash
from ntp_jax import train
from ntp_jax.training.trainer import train as trainer_train
assert train is trainer_train and ntp_jax.train is trainer_train
values = {name: getattr(ntp_jax, name) for name in ntp_jax.__all__}
assert all(v.__name__ == name for name, v in values.items()), values
try:
  ntp_jax.no_such_name
except AttributeError as err:
  print(err)
"""


def test_public_names_resolve_lazily():
  done = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, env=process_env(),
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == "module 'ntp_jax' has no attribute 'no_such_name'"
