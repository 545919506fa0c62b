"""TP groups used across tests: every degree 1..8, failures in the middle, at the ends, several.

Parametrize with ``tp_groups()``: the groups in ``FAST_GROUPS`` run in the fast tier
(``-m "not slow"``), the others in the full suite only.
"""

import pytest

TP_GROUPS = [
    (1, ()),  # degree 1
    (2, ()),  # degree 2
    (3, ()),  # degree 3
    (4, (1,)),  # degree 3, middle
    (8, (0, 1, 2, 3)),  # degree 4, one end
    (5, ()),  # degree 5
    (8, (2, 5)),  # degree 6, several
    (8, (3,)),  # degree 7, middle
    (8, (0,)),  # degree 7, first
    (8, (7,)),  # degree 7, last
    (8, ()),  # degree 8
]


def group_id(group):
  tp, failed = group
  return f"tp{tp}-failed{','.join(map(str, failed)) or 'none'}"


# The fast tier's plans: uneven with a shared KV group (degree 3), the main case (degree 7 of 8,
# a failure in the middle), half the group lost at one end (degree 4), and healthy (degree 8).
FAST_GROUPS = {(3, ()), (8, (3,)), (8, (0, 1, 2, 3)), (8, ())}


def tp_groups(extra=()):
  """``TP_GROUPS`` (and ``extra``) as ``pytest.param``s; those outside ``FAST_GROUPS`` are slow."""
  return [pytest.param(g, id=group_id(g), marks=() if g in FAST_GROUPS else pytest.mark.slow)
          for g in [*TP_GROUPS, *extra]]
