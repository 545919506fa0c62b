"""Entry point of ``python -m ntp_jax.sim``."""

import sys

from ntp_jax.sim.cli import main

if __name__ == "__main__":
  sys.exit(main())
