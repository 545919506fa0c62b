"""Plans and the compiled programs that run them.

- ``plan``: ``make_plan``, the DP replicas of a job, their TP degrees, classes and batch
  shares (``ntp.rebalance``); the plans one failure or repair away.
- ``programs``, ``steps``: one compiled step per class of replicas; ``step_modes``,
  ``job_step``, ``sharded_step``: the job's step over every class, one class per way of
  stepping (fused, synced, committed, sharded optimizer state).
- ``zero``, ``zero_survivors``, ``master_weights``, ``metrics_handoff``: the optimizer state
  sharded over the peer groups.
- ``sync``, ``sync_leaf``, ``regroup``: the exact gradient sync between classes of different
  TP degree; ``grad_norm``: clipping by the logical norm; ``accumulate``: micro-batches.

Processes (``ntp_jax.processes``) and reading compiled programs back
(``ntp_jax.analysis``) live beside it.
"""
