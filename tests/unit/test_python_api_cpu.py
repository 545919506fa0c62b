"""``train(config)`` from Python on a CPU with one device: the error says how to get more."""

import subprocess
import sys

from helpers import ROOT, process_env

from ntp_jax.errors import too_few_devices

CHECK = """
import configs.gpt_tiny
import ntp_jax

config = configs.gpt_tiny.get_config()
config.workdir = {workdir!r}
try:
  ntp_jax.train(config, log=lambda *_, **__: None)
except ntp_jax.ConfigError as err:
  print(err)
"""


def test_train_on_one_cpu_device_says_how_to_simulate_more(tmp_path):
  # No device count in XLA_FLAGS: JAX starts with one CPU device, as in a user's script.
  done = subprocess.run([sys.executable, "-c", CHECK.format(workdir=str(tmp_path))], cwd=ROOT,
                        env=process_env(devices=None), capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip() == (
      "mesh.dp x mesh.tp: 8 devices needed, 1 present (cpu); on CPU, set "
      "XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts (before its first "
      "use of a device), or lower mesh.dp or mesh.tp")


def test_the_hint_is_for_cpu_only_and_counts_per_process():
  on_gpu = too_few_devices(("mesh.tp",), 8, 4, "gpu")
  assert str(on_gpu) == "mesh.tp: 8 devices needed, 4 present (gpu)"
  assert "device_count=4 before" in str(too_few_devices(("mesh.dp", "mesh.tp"), 8, 2, "cpu", 2))
  # 8 devices over 3 processes: no count per process gives them; the nearest counts that do.
  uneven = str(too_few_devices(("mesh.dp", "mesh.tp"), 8, 6, "cpu", 3))
  assert uneven == ("mesh.dp x mesh.tp: 8 devices needed, 6 present (cpu, 3 processes); 8 "
                    "devices do not split evenly over 3 processes: run 2 or 4 processes (e.g. "
                    "python -m ntp_jax.launch --processes=2 --devices-per-process=4), or "
                    "change mesh.dp or mesh.tp")
