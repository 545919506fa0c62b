"""The collectives of a compiled program, read from its HLO text.

XLA's cost analysis gives flops and bytes accessed but not what crosses the
wire. This reads every collective instruction of the optimized HLO
(``compiled.as_text()``): its kind, the bytes of its result and the size of
its device groups, so a benchmark or a test can count all-reduce bytes per
step and find collectives over a group of one device (a copy that waits on
nothing). Instructions inside a loop body are listed once, as XLA's cost
analysis counts them; measure unrolled programs for per-step totals.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

# Bytes per element of the HLO primitive types a training step uses.
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2,
                  "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# "%name = TYPE kind(", or "kind-start(" / "kind-done(" (asynchronous, on GPU); TYPE may be a
# tuple. A start's tuple also holds its operands, so the bytes are read from its done.
_INSTRUCTION = re.compile(
    r"%?(?P<name>[\w.\-]+)\s*=\s+(?P<type>.+?)\s+(?P<kind>" + "|".join(KINDS)
    + r")(?P<phase>-start|-done)?\((?P<rest>.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_PAIRS = re.compile(r"\{(\d+),(\d+)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction: ``kind`` (e.g. ``"all-reduce"``), ``bytes`` of its
  result (all tuple elements), ``group_size`` (devices per group; 0 when the
  instruction names no groups, i.e. all devices)."""

  kind: str
  bytes: int
  group_size: int


def _type_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if dtype not in _ELEMENT_BYTES:
      continue
    count = 1
    for d in filter(None, dims.split(",")):
      count *= int(d)
    total += count * _ELEMENT_BYTES[dtype]
  return total


def _group_size(rest: str) -> int:
  iota = _IOTA_GROUPS.search(rest)
  if iota:
    return int(iota.group(2))
  explicit = _EXPLICIT_GROUPS.search(rest)
  if explicit:
    first = explicit.group(1).split("}")[0].lstrip("{")
    return len([d for d in first.split(",") if d])
  return 0


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective instruction of an HLO module's text, in order of appearance.

  Args:
    hlo_text: ``compiled.as_text()`` of a ``jax.jit(...).lower(...).compile()``.
  """
  out = []
  started: dict[str, int] = {}  # asynchronous starts: name -> group size
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.search(line)
    if match is None:
      continue
    kind, phase, rest = match.group("kind"), match.group("phase"), match.group("rest")
    if phase == "-done":
      operand = re.match(r"[^%]*%([\w.\-]+)", rest)
      if operand and operand.group(1) in started:
        out.append(Collective(kind, _type_bytes(match.group("type")),
                              started.pop(operand.group(1))))
      continue
    group = _group_size(rest)
    if kind == "collective-permute":  # a pair list; only self-sends make it a group of one
      pairs = _PAIRS.findall(rest)
      group = 1 if pairs and all(a == b for a, b in pairs) else 2
    if phase == "-start":
      started[match.group("name")] = group
    else:
      out.append(Collective(kind, _type_bytes(match.group("type")), group))
  return out


@dataclasses.dataclass(frozen=True)
class CollectiveTotals:
  """Counts and bytes of a program's collectives, by kind, and those over one device."""

  ops: dict[str, int]
  bytes: dict[str, int]
  singleton_ops: int
  singleton_bytes: int

  def scaled(self, other: CollectiveTotals, times: float) -> CollectiveTotals:
    """``self + times * (other - self)``: extend per-layer differences (see
    ``ntp_jax.training.footprint.per_device_flops``)."""
    def extend(a, b):
      return {k: round(a.get(k, 0) + times * (b.get(k, 0) - a.get(k, 0))) for k in set(a) | set(b)}
    return CollectiveTotals(
        extend(self.ops, other.ops), extend(self.bytes, other.bytes),
        round(self.singleton_ops + times * (other.singleton_ops - self.singleton_ops)),
        round(self.singleton_bytes + times * (other.singleton_bytes - self.singleton_bytes)))


def totals(found: Iterable[Collective]) -> CollectiveTotals:
  """Sum ``collectives(...)`` by kind; a group of one is counted apart as well."""
  ops: dict[str, int] = {}
  size: dict[str, int] = {}
  singleton_ops = singleton_bytes = 0
  for c in found:
    ops[c.kind] = ops.get(c.kind, 0) + 1
    size[c.kind] = size.get(c.kind, 0) + c.bytes
    if c.group_size == 1:
      singleton_ops += 1
      singleton_bytes += c.bytes
  return CollectiveTotals(ops, size, singleton_ops, singleton_bytes)
