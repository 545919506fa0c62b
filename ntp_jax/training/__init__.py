"""Training runs: ``train.py`` and ``train()`` on top of the library.

- ``config``: ``RunConfig``, every field typed and checked once; ``cli``: the command line.
- ``trainer``: ``train()``, set-up and the end of a run; ``loop``: ``TrainingRun``, steps,
  failures, repairs and recovery, made of ``run_state`` (plan, programs, step, cursor),
  ``recovery`` (the typed record of each recovery) and ``process_guard`` (arrival, lost
  processes, the stop that ends this one); ``hooks``: what runs around every step, and
  the services a hook may use.
- ``optim``: the optimizer (a model reaches the trainer as an ``ntp_jax.model.ModelSpec``).
- ``stored_run``: ``StoredRun``, one reader of a checkpoint step's metadata and config.
- ``resume``, ``just_in_time``: restarts from checkpoints; ``precompile``, ``compilation``:
  programs compiled ahead and the persistent compilation cache.
- ``metrics``, ``report``, ``run_plot``: records, tables and the whole-run plot;
  ``footprint``, ``resources``: the memory and compute plan from abstract shapes.
"""
