"""Failures while training and what they cost.

- ``events``: scheduled failures and repairs (``ntp.fail_at``, ``ntp.repair_at``) and
  ``DeviceFailure`` from a detector.
- ``heartbeat``: lost processes named within a timeout; stops agreed by every process.
- ``arrival``: before a step's collectives across processes, every process says it has
  arrived, so a survivor meets a lost peer outside a collective.
- ``signals``: SIGTERM and Ctrl-C end a run at a step boundary.
- ``goodput``: where a run's time went (productive, recovery, redone, checkpoints).
"""
