"""Plans and the compiled programs that run them.

- ``plan``: ``make_plan``, the DP replicas of a job, their TP degrees, classes and batch
  shares (``ntp.rebalance``); the plans one failure or repair away.
- ``programs``, ``steps``, ``job_step``: one compiled step per class of replicas, and the
  job's step over every class.
- ``sync``, ``sync_leaf``, ``regroup``: the exact gradient sync between classes of different
  TP degree; ``grad_norm``: clipping by the logical norm; ``accumulate``: micro-batches.

Processes (``ntp_jax.processes``) and reading compiled programs back
(``ntp_jax.analysis``) live beside it.
"""
