"""Test set-up: 8 simulated CPU devices and the suite's codegen flags (``tests/codegen.py``),
fixed before JAX starts, one compilation cache per run, the TP plans of each tier, and the
slowest tiers handed out first.

The tiers are folders: ``unit`` (no sharded program), ``ops`` (every sharded operation
against its dense reference on the fast plans), ``plans`` (the same checks on the other TP
plans, whole multi-step jobs of mixed-degree replicas), ``integration`` (``train()`` in this
process), ``system`` (subprocesses and multi-process jobs). The fast tier is ``tests/unit
tests/ops``.

Many tests compile the same programs (gpt_micro on the same plans) in several processes: xdist
workers and the ``train.py`` subprocesses they start. One persistent compilation cache per
test run, shared through the environment, compiles each program once; it holds XLA
executables keyed by the program and its options, so no result depends on it. It is
removed at the end. (A workdir's BPE on the 300 kB corpus takes about 0.3 s here: a shared
data cache would not pay.)
"""

import os
import shutil
import tempfile

from codegen import CODEGEN_FLAGS

_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                         f"ntp_jax_tests_{_RUN}")
  os.environ["NTP_JAX_TESTS_OWN_CACHE"] = "1"  # this run made it: remove it at the end
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Codegen flags that halve compile time (tests/codegen.py); every parity check compares
# programs compiled alike, and subprocesses inherit them (helpers.process_env).
_flags = os.environ.get("XLA_FLAGS", "").split()
_flags += [f for f in CODEGEN_FLAGS if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
if not any(f.startswith("--xla_force_host_platform_device_count") for f in _flags):
  _flags.append("--xla_force_host_platform_device_count=8")
os.environ["XLA_FLAGS"] = " ".join(_flags)

import jax  # noqa: E402  (must come after XLA_FLAGS)
from tp_cases import group_id, groups_for  # noqa: E402

jax.config.update("jax_enable_x64", False)

if len(jax.devices()) < 8:
  raise RuntimeError(
      f"tests need 8 devices, found {len(jax.devices())}; "
      "XLA_FLAGS was set before conftest ran")


def pytest_generate_tests(metafunc):
  """``@pytest.mark.tp_groups(fast=..., extra=...)``: the fast groups in ``tests/ops``, the
  others where ``tests/plans`` imports the check."""
  marker = metafunc.definition.get_closest_marker("tp_groups")
  if marker is None:
    return
  more = metafunc.module.__name__.startswith("plans.")
  groups = groups_for(more, **marker.kwargs)
  metafunc.parametrize("group", groups, ids=[group_id(g) for g in groups])


def pytest_unconfigure(config):
  """The run's compilation cache goes with the run (the controller removes it, last)."""
  if not hasattr(config, "workerinput") and os.environ.get("NTP_JAX_TESTS_OWN_CACHE"):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


SLOWEST_FIRST = ("system", "integration", "plans", "ops", "unit")


def pytest_collection_modifyitems(items):
  """The slowest tiers first: xdist hands tests out in this order, so the long subprocess runs
  start early and the quick unit tests fill the end, and both workers finish together."""
  def tier(item):
    folder = item.nodeid.split("/")[1] if item.nodeid.count("/") >= 2 else ""
    return SLOWEST_FIRST.index(folder) if folder in SLOWEST_FIRST else len(SLOWEST_FIRST)
  items.sort(key=tier)  # stable: the order inside a tier stays
