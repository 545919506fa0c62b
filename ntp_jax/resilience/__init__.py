"""Failures while training and what they cost.

- ``events``: scheduled failures and repairs (``ntp.fail_at``, ``ntp.repair_at``) and
  ``DeviceFailure`` from a detector.
- ``signals``: SIGTERM and Ctrl-C end a run at a step boundary.
- ``goodput``: where a run's time went (productive, recovery, redone, checkpoints).

Lost processes (the heartbeat, arrival) are ``ntp_jax.processes``.
"""
