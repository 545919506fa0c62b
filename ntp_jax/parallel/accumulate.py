"""Gradient accumulation: a replica's share of the step run as several micro-batches.

The share's rows are cut into ``count`` micro-batches as equal as rows allow
(``micro_batches``): at most two sizes, ``q + 1`` and ``q`` rows. Each size
runs under one ``jax.lax.scan``, so the compiled program holds at most two
copies of the model's forward and backward, whatever the count. The losses
and gradients of the micro-batches are summed, with the same normalisation
as the single pass (the step's global token count), so the step equals the
single pass up to the order of the additions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def micro_batches(rows: int, count: int) -> list[tuple[int, int]]:
  """``(micro-batches, rows each)`` groups that cut ``rows`` into ``count`` near-equal parts.

  Raises:
    ValueError: ``count`` < 1, or more micro-batches than rows.
  """
  if count < 1 or count > rows:
    raise ValueError(f"micro-batches: cannot cut {rows} row(s) into {count} micro-batch(es)")
  q, r = divmod(rows, count)
  return [(n, size) for n, size in ((r, q + 1), (count - r, q)) if n]


def micro_starts(rows: int, count: int) -> list[tuple[int, int]]:
  """``(start, size)`` of each micro-batch of a replica's ``rows`` cut into ``count``
  (``micro_batches``: the larger ones first), in order.

  Raises:
    ValueError: ``count`` < 1, or more micro-batches than rows.
  """
  out, start = [], 0
  for n, size in micro_batches(rows, count):
    for _ in range(n):
      out.append((start, size))
      start += size
  return out


def accumulate(value_and_grad: Callable[[Any, jax.Array], tuple[jax.Array, Any]], params: Any,
               batch: jax.Array, count: int, scan: bool = True) -> tuple[jax.Array, Any]:
  """``value_and_grad(params, rows)`` summed over ``count`` micro-batches of ``batch``.

  Args:
    value_and_grad: ``(params, rows) -> (loss, grads)`` of one micro-batch
      (``rows`` int32 ``[n, seq_len + 1]``); the loss is already normalised by
      the step's token count, so sums add up to the whole share's.
    params: the parameters (any pytree).
    batch: int32 ``[rows, seq_len + 1]``, the replica's share.
    count: micro-batches (1: one pass, no loop).
    scan: run each size under ``jax.lax.scan``; False unrolls a Python loop (for
      XLA's cost analysis, which counts a loop body once).

  Returns:
    ``(loss, grads)`` summed over the micro-batches, in ``params``' structure.
  """
  if count == 1:
    return value_and_grad(params, batch)
  # Gradients are carried from zeros of the parameters' types; losses leave each step as an
  # output (their types, e.g. varying over 'dp' or not, need no initial value).
  grads = jax.tree.map(jnp.zeros_like, params)
  losses = []
  start = 0
  for n, size in micro_batches(batch.shape[0], count):
    chunks = batch[start:start + n * size].reshape(n, size, *batch.shape[1:])
    start += n * size
    if not scan:
      for i in range(n):
        value, more = value_and_grad(params, chunks[i])
        grads = jax.tree.map(jnp.add, grads, more)
        losses.append(value[None])
      continue

    def body(carry, rows):
      value, more = value_and_grad(params, rows)
      return jax.tree.map(jnp.add, carry, more), value

    grads, values = jax.lax.scan(body, grads, chunks)
    losses.append(values)
  return jnp.sum(jnp.concatenate(losses)), grads
