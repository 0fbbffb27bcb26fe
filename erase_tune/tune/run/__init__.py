"""Running a job: ``erase-tune start`` from set-up to its confirmed front.

``job`` sets a job up (or resumes it) and runs it; ``loop`` is one driver's ask → submit →
tell, shared by any number of drivers; ``record`` puts an outcome into the study and the
project's tables; ``journal`` keeps outcomes on local disk while the storage is away;
``confirm`` takes the second look (speed, then quality) before a plan leaves the study,
and ``remote`` opens the executor ``export`` confirms on. ``check`` is ``erase-tune check``:
what ``start`` would do before its first trial, in this process, with no Ray and no storage
(and the estimate of a job's phases, which ``job`` logs too).
"""
