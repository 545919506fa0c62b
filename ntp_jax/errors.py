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
  if platform == "cpu" and needed % processes:  # no device count per process gives it
    counts = [p for p in range(1, needed + 1) if needed % p == 0 and p != processes]
    near = sorted(counts, key=lambda p: (abs(p - processes), p))[:2]
    first = min(near)  # more devices per process: TP groups more likely stay whole
    message += (f"; {needed} devices do not split evenly over {processes} processes: run "
                f"{' or '.join(str(p) for p in sorted(near))} processes (e.g. python -m "
                f"ntp_jax.launch --processes={first} --devices-per-process={needed // first}),"
                f" or change {' or '.join(fields)}")
  elif platform == "cpu":
    message += (f"; on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{needed // processes} before JAX starts (before its first use of a device"
                + (", in every process: python -m ntp_jax.launch --devices-per-process="
                   f"{needed // processes}" if processes > 1 else "")
                + f"), or lower {' or '.join(fields)}")
  return ConfigError(message)
