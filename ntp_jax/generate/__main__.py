"""``python -m ntp_jax.generate``: see ``ntp_jax.generate.cli``."""

import sys

from ntp_jax.generate.cli import main

if __name__ == "__main__":
  sys.exit(main())
