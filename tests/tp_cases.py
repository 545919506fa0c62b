"""TP groups used across tests: every degree 1..8, failures in the middle, at the ends, several.

A parity check marked ``@pytest.mark.tp_groups()`` takes a ``group`` argument, ``(tp, failed
slots)``. In ``tests/ops/`` (the fast tier) it runs on ``FAST_GROUPS``; ``tests/plans/``
imports the same check and runs it on every other group of ``TP_GROUPS`` (``conftest.py``).
"""

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

# The fast tier's plans: uneven with a shared KV group (degree 3), the main case (degree 7 of 8,
# a failure in the middle), half the group lost at one end (degree 4), and healthy (degree 8).
FAST_GROUPS = ((3, ()), (8, (3,)), (8, (0, 1, 2, 3)), (8, ()))


def group_id(group):
  tp, failed = group
  return f"tp{tp}-failed{','.join(map(str, failed)) or 'none'}"


def groups_for(more, fast=FAST_GROUPS, extra=(), others=None):
  """``fast`` for the fast tier; for ``tests/plans`` (``more``), ``others`` if given, else the
  rest of ``TP_GROUPS`` and ``extra``."""
  if not more:
    return list(fast)
  if others is not None:
    return list(others)
  return [g for g in [*TP_GROUPS, *extra] if g not in tuple(fast)]
