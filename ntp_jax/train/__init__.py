"""Training runs: ``train.py`` and ``train()`` on top of the library.

- ``config``: ``RunConfig``, every field typed and checked once; ``cli``: the command line.
- ``trainer``: ``train()``, set-up and the end of a run; ``loop``: ``TrainingRun``, steps,
  failures, repairs and recovery; ``hooks``: what runs around every step.
- ``model_spec``: what a model gives the trainer (``ModelSpec``); ``optim``: the optimizer.
- ``resume``, ``just_in_time``: restarts from checkpoints; ``precompile``, ``compilation``:
  programs compiled ahead and the persistent compilation cache.
- ``metrics``, ``report``, ``run_plot``: records, tables and the whole-run plot;
  ``footprint``, ``resources``: the memory and compute plan from abstract shapes.
"""
