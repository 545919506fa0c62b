"""``python -m ntp_jax.generate --help`` names the ``--config.*`` settings it reads."""

import pytest

from ntp_jax.generate.cli import SETTINGS, main


def test_help_names_every_config_setting(capsys):
  with pytest.raises(SystemExit) as done:
    main(["--help"])
  assert done.value.code == 0
  shown = capsys.readouterr().out
  assert "[--config.FIELD=VALUE ...]" in shown.splitlines()[0]
  for name in [*SETTINGS, "model.FIELD"]:
    assert f"--config.{name}=" in shown, name
