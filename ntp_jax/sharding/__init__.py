"""Uneven tensor-parallel shards, below everything else in ntp_jax.

- ``layout``: ``Layout``, the split of one dimension into units over the live slots of a TP
  group (uneven counts, a shared unit split by position), padded to one block per slot.
- ``blocks``: logical arrays to and from padded per-slot blocks.
- ``collectives``: all-gather, reduce-scatter and sums of padded blocks inside
  ``jax.shard_map`` over the ``'tp'`` axis.
- ``mesh``: a replica class's device mesh, axes ``('dp', 'tp')``.
- ``topology``: which devices are this process's.

Source followed: Arfeen et al., "Nonuniform Tensor Parallelism" (arXiv:2504.06095), sec. 4.
"""
