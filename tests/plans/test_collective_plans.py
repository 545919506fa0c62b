"""The uneven collectives of ``tests/ops/test_collectives.py`` on the other TP plans."""

from ops.test_collectives import (  # noqa: F401  (collected here on the other plans)
  test_all_gather_uneven,
  test_reduce_scatter_uneven,
)
