"""Logical training state on and off a plan.

- ``placement``: put logical arrays into a class's padded blocks and read them back.
- ``sources``: where logical state comes from (fresh parameters, host arrays; checkpoints
  and live peers are sources too).
- ``checkpoint``: orbax-checkpoint checkpoints of logical state, restorable onto any plan.
- ``peer``: live recovery from DP peers' replicas; ``peer_move`` moves only the units whose
  device changes, in one process or across processes.
- ``spanning``: logical state as arrays that span every process (multi-process
  checkpoints and restore).
"""
