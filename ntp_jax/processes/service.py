"""JAX's coordination service in a process that drives no device.

``jax.distributed.initialize`` starts the coordination service (key-value
store, barriers, heartbeats) inside process 0, so losing process 0 ends every
other process (JAX's client aborts when its service is gone), however well
the survivors could go on. A GPU of process 0 fails as often as any other.
So the service can run elsewhere: in ``python -m ntp_jax.launch`` (one
machine) or ``python -m ntp_jax.coordinator`` (a cluster, beside ``srun``),
and every worker, process 0 included, joins it as a client only
(``join_without_service``). Any worker can then be lost and survived.

Uses JAX's own service and client objects (``jax._src.distributed``), as
``jax.distributed.initialize`` does; only the start of the service in process
0 is left out.
"""

from __future__ import annotations

import contextlib
from typing import Any

ENV_EXTERNAL_SERVICE = "NTP_JAX_EXTERNAL_SERVICE"  # "1": the workers' service runs elsewhere
# JAX's own heartbeat timeout for a service whose workers' setting is not known here: long,
# so that ours (``distributed.heartbeat_timeout_s``) names a lost process first.
SERVICE_HEARTBEAT_S = 120


def serve(bind_address: str, num_processes: int, *, heartbeat_timeout_s: int = SERVICE_HEARTBEAT_S,
          recoverable: bool = True) -> Any:
  """Start JAX's coordination service for ``num_processes`` workers on ``bind_address``
  (``host:port``, or ``[::]:port`` for every address); returns it (``shutdown()`` ends it).

  ``recoverable``: the service lets workers be lost without ending the others
  (``jax_enable_recoverability`` on the workers must agree).

  Raises:
    RuntimeError: this JAX has no such service object (its private API moved).
  """
  from jax._src.lib import _jax  # the runtime JAX's own initialize uses

  make = getattr(_jax, "get_distributed_runtime_service", None)
  if make is None:
    raise RuntimeError("this JAX version has no get_distributed_runtime_service: run the "
                       "coordination service in process 0 (distributed.external_coordinator"
                       "=False)")
  return make(bind_address, num_processes, heartbeat_timeout=heartbeat_timeout_s,
              shutdown_timeout=300, recoverable=recoverable)


class _NoService:
  """Stands for the service ``jax.distributed.initialize`` would start in process 0."""

  def shutdown(self) -> None:
    pass


class _WithoutService:
  """JAX's runtime module with the service's start replaced by ``_NoService``."""

  def __init__(self, runtime):
    self._runtime = runtime

  def get_distributed_runtime_service(self, *args, **kwargs) -> _NoService:
    return _NoService()

  def __getattr__(self, name):
    return getattr(self._runtime, name)


@contextlib.contextmanager
def no_service_in_process_0():
  """Within it, ``jax.distributed.initialize`` in process 0 joins as a client only."""
  from jax._src import distributed as jax_distributed

  runtime = jax_distributed._jax
  jax_distributed._jax = _WithoutService(runtime)
  try:
    yield
  finally:
    jax_distributed._jax = runtime
