"""User-input errors: one line that names the config field to fix."""


class ConfigError(ValueError):
  """A bad setting; ``str(err)`` is one line starting with the field name (``ntp.failed: ...``)."""

  def __init__(self, message: str):
    super().__init__(" ".join(str(message).split()))
