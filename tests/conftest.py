"""Test set-up: 8 simulated CPU devices, fixed before JAX starts, and one compilation cache.

Many tests compile the same programs (gpt_tiny on the same plans) in several
processes: xdist workers and the ``train.py`` subprocesses they start. One
persistent compilation cache per test run, shared through the environment,
compiles each program once; it holds XLA executables keyed by the program
and its options, so no result depends on it. It is removed at the end.
"""

import os
import shutil
import tempfile

_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                         f"ntp_jax_tests_{_RUN}")
  os.environ["NTP_JAX_TESTS_OWN_CACHE"] = "1"  # this run made it: remove it at the end
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (must come after XLA_FLAGS)
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)

if len(jax.devices()) < 8:
  raise RuntimeError(
      f"tests need 8 devices, found {len(jax.devices())}; "
      "XLA_FLAGS was set before conftest ran")


@pytest.hookimpl(tryfirst=True)  # before -m / -k deselect: every collected test is seen
def pytest_collection_modifyitems(config, items):
  """Mark the full-suite-only tests (``tests/tiers.py``) ``slow``; a stale id is an error."""
  from tiers import SLOW

  ids = {item.nodeid for item in items}
  for item in items:
    if item.nodeid in SLOW:
      item.add_marker(pytest.mark.slow)
  files = {i.split("::")[0] for i in ids}  # a file collected whole can tell an id is gone
  stale = sorted(i for i in SLOW - ids if i.split("::")[0] in files and "::" in i)
  if stale and not any("::" in a for a in config.args):
    raise pytest.UsageError(f"tests/tiers.py names tests that do not exist: {stale}")


def pytest_unconfigure(config):
  """The run's compilation cache goes with the run (the controller removes it, last)."""
  if not hasattr(config, "workerinput") and os.environ.get("NTP_JAX_TESTS_OWN_CACHE"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
