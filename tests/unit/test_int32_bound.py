"""Where the split step's int32 bound applies (``sync_leaf.int32_overrun``): a parameter's
own run always; a buffer's row only under the sharded optimizer, which cuts rows into pieces
at dynamic offsets (the sync alone slices them at static ones)."""

import dataclasses

from ntp_jax.parallel.sync_leaf import INT32_MAX, buffer_shapes, int32_overrun


@dataclasses.dataclass(frozen=True)
class Run:
  """A replicated variable's sync descriptor, reduced to what the bound reads."""

  key: str
  numel: int
  block: int
  buffer: str = "float32"


def test_a_buffer_row_past_int32_binds_the_sharded_optimizer_only():
  half = INT32_MAX // 2 + 1
  leaves = (Run("a", 1, half), Run("b", 1, half))  # each run fits; together they do not
  assert buffer_shapes(leaves) == {"float32": (2 * half + 1,)}  # and the loss element
  assert int32_overrun(leaves, sharded=False) is None
  assert int32_overrun(leaves, sharded=True) == ("the float32 sync buffer", 2 * half + 1)


def test_a_run_past_int32_binds_every_split_step():
  leaves = (Run("a", INT32_MAX, 1),)  # its elements plus its run
  assert int32_overrun(leaves, sharded=False) == ("a", INT32_MAX + 1)
