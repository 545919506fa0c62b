"""The processes of a multi-process job: joining it, watching each other, meeting a loss.

- ``distributed``: ``jax.distributed`` set-up from the config (or ``python -m
  ntp_jax.launch``, SLURM, Open MPI), device order, scale-up domains, this process's
  ``Job``.
- ``heartbeat``: a peer that went silent is named within ``distributed.heartbeat_timeout_s``;
  a stop signal becomes one step at which every process stops.
- ``links``: one idle connection to every peer: a process that dies is named as soon as
  its kernel closes them, long before its heartbeat falls silent for the timeout.
- ``arrival``: before a step's collectives across processes, every process says it has
  arrived, so a survivor meets a lost peer outside a collective.

Imports no JAX at package level (``train.py`` reads the exit status before ``XLA_FLAGS``
are set).
"""
