"""User-input errors: one line that names the config field to fix."""


class ConfigError(ValueError):
  """A bad setting; ``str(err)`` is one line starting with the field name (``ntp.failed: ...``)."""

  def __init__(self, message: str):
    super().__init__(" ".join(str(message).split()))



def too_few_devices(fields: tuple[str, ...], needed: int, present: int, platform: str,
                    processes: int = 1) -> ConfigError:
  """The error for a mesh that needs ``needed`` devices where ``present`` are.

  On CPU it says how to get more: XLA simulates host devices when
  ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` is set before JAX starts its
  backend (``train.py`` and ``python -m ntp_jax.generate`` set it themselves; a Python
  caller must), ``N`` per process.

  Args:
    fields: the config fields whose product is ``needed`` (``("mesh.dp", "mesh.tp")``).
    platform: the devices' platform (``"cpu"``, ``"gpu"``, ...).
    processes: processes in the job (their devices are counted together).
  """
  message = (f"{' x '.join(fields)}: {needed} devices needed, {present} present ({platform}"
             + (f", {processes} processes)" if processes > 1 else ")"))
  if platform == "cpu":
    per_process = -(-needed // processes)
    message += (f"; on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{per_process} before JAX starts (before its first use of a device), or "
                f"lower {' or '.join(fields)}")
  return ConfigError(message)
