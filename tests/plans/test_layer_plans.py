"""The layer checks of ``tests/ops/test_layers.py`` on the other TP plans (``tp_cases``)."""

from ops.test_layers import (  # noqa: F401  (collected here on the other plans)
  test_attention,
  test_column_parallel_linear,
  test_cross_entropy,
  test_row_parallel_linear,
  test_swiglu,
  test_vocab_parallel_embedding,
)
