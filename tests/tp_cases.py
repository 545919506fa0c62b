"""TP groups used across tests: every degree 1..8, failures in the middle, at the ends, several."""

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
