"""Executing trials on Ray: what crosses to a worker, and the workers themselves.

``task`` is what a worker runs (a plain, picklable spec in, a typed outcome out: the seam with
the library); ``outcome`` is that outcome; ``actors`` are the warm Ray actors (one per rank, a
group per trial slot); ``executor`` schedules trials on them and survives their loss;
``distributed`` runs a trial of several ranks; ``reaper`` makes the private local Ray die
with its driver.
"""
