"""The tuning service: search spaces, the Optuna study, Ray trial workers, the job loop.

A thin layer over the library (``runtime``, ``workloads``, ``measure``, ``trial``,
``confirm``), read in this order:

- ``space`` / ``space_file``: which plans a study may propose; ``checks``: a space checked
  against its model before any trial runs;
- ``job``: ``erase-tune start`` — set-up and resume policy; ``loop``: ask → submit → tell,
  shared by any number of drivers; ``record``: an outcome into the study and the tables;
  ``journal``: outcomes kept on local disk while the storage is away;
- ``worker`` / ``outcome``: what runs in a trial worker and the typed outcome it returns;
  ``workers`` / ``executor``: warm Ray worker groups, one per trial slot; ``reaper``: the
  private local Ray dies with its driver;
- ``study``: objective and attribute names, samplers, the Pareto front;
- ``status``, ``export`` (with the confirming re-measurement), ``remote``, ``tables``,
  ``dashboard``: reading a job back.
"""
