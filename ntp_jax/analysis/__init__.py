"""What XLA compiled, read back: executed flops and collective bytes.

- ``cost``: flops and bytes per device of a plan's class programs from XLA's cost
  analysis (``compiled.cost_analysis()``), healthy against degraded classes.
- ``hlo_collectives``: the collectives of a compiled HLO module and the bytes each
  moves, for comparing the NTP step with plain GSPMD.
"""
