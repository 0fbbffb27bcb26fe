"""The tuning service: a thin layer over the library (``runtime``, ``workloads``, ``measure``:
its trial, confirm and noise), in four rooms, read in this order:

- :mod:`~erase_tune.tune.search`: which plans a study may propose (the space file, the space and
  its codec to and from Optuna parameters, its checks against the model), the samplers, and
  the Optuna study;
- :mod:`~erase_tune.tune.run`: ``erase-tune start`` — set-up and resume, the ask → submit → tell
  loop of each driver, recording outcomes, the journal, the confirmations before export;
- :mod:`~erase_tune.tune.execute`: trials on Ray — the spec a worker runs and the outcome it
  returns, warm actors, the executor, multi-rank trials;
- :mod:`~erase_tune.tune.views`: reading a job back — status, export, report, dashboard.

Each room imports from the ones above it in this list only where it must: ``views`` and
``run`` use ``search`` and ``execute``; ``execute`` and ``search`` use neither.
"""
