"""erase-tune's default sampler: one change at a time to a plan on the feasible Pareto front.

Replayed studies on plans measured on an H200 (docs/benchmarks.md, "Tuner efficiency")
showed why Optuna's general-purpose samplers are slow here: a good ERASE plan is a small
edit of another good plan (place one more subarch, detach one, move one to another stream),
while TPE, NSGA-II and GP spend their first dozens of trials learning what a neighbourhood
is. :class:`FrontSampler` searches the neighbourhood directly. After ``n_startup_trials``
complete trials (the enqueued seeds count), it takes, uniformly at random, one of the plans
one change away from a trial on the Pareto front of the trials within the NE budget
(Optuna's ``constraints``): one categorical to another choice, or one number to a random
draw, never a parameter set a trial already had (a repeat is answered from the earlier
measurement and adds nothing). Parameters a change makes appear (the space is conditional)
are drawn at random, and with probability ``restart`` a whole trial is drawn at random, which
keeps the search from settling on one region. Only Optuna's public sampler interface is used.

A model-guided choice among the neighbours (Thompson sampling on an additive model of each
objective) was tried on the same replay and found fewer good plans per trial than the
uniform choice (docs/benchmarks.md), so it is not used.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import FrozenTrial, TrialState

__all__ = ["FrontSampler"]


class FrontSampler(BaseSampler):
    """Mutate one parameter of a feasible Pareto-front trial (see the module docstring)."""

    def __init__(self, *, seed: int | None = None, n_startup_trials: int = 2, restart: float = 0.05) -> None:
        self._rng = np.random.RandomState(seed)
        self._random = RandomSampler(seed=seed)
        self._n_startup = n_startup_trials
        self._restart = restart
        self._plans: dict[int, dict[str, Any] | None] = {}

    def reseed_rng(self) -> None:
        self._rng = np.random.RandomState()
        self._random.reseed_rng()

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values is not None]
        if len(done) < self._n_startup or not done or self._rng.rand() < self._restart:
            self._plans[trial.number] = None
            return
        feasible = [t for t in done if all(v <= 0 for v in t.constraints.values())] or done
        front = [t for t in feasible if not any(_dominates(o, t, study) for o in feasible)]
        self._plans[trial.number] = self._mutation(front, study, trial)

    def _mutation(self, front: list[FrozenTrial], study: optuna.Study, trial: FrozenTrial) -> dict[str, Any] | None:
        """A front trial's parameters with one changed, never a set a trial already had
        (running ones included); a parameter the change makes appear (the space is
        conditional) is left out and drawn at random later. One of all such neighbours, uniformly;
        None (a random trial) when there is none."""
        seen = {frozenset(t.params.items()) for t in study.get_trials(deepcopy=False)}
        out: dict[frozenset, dict[str, Any]] = {}
        for parent in front:
            for name in sorted(parent.params):
                dist = parent.distributions[name]
                if isinstance(dist, CategoricalDistribution):
                    values = [c for c in dist.choices if c != parent.params[name]]
                else:  # a number: one fresh draw (several would crowd out the categorical changes)
                    values = [self._random.sample_independent(study, trial, name, dist)]
                for value in values:
                    params = {**parent.params, name: value}
                    key = frozenset(params.items())
                    if key not in seen:
                        out.setdefault(key, params)
        if not out:
            return None
        neighbours = list(out.values())
        return neighbours[self._rng.randint(len(neighbours))]

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        params = self._plans.get(trial.number)
        if params is None or param_name not in params or not _fits(params[param_name], param_distribution):
            return self._random.sample_independent(study, trial, param_name, param_distribution)
        return params[param_name]

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Any) -> None:
        self._plans.pop(trial.number, None)


def _dominates(a: FrozenTrial, b: FrozenTrial, study: optuna.Study) -> bool:
    better = False
    for x, y, d in zip(a.values, b.values, study.directions):
        if d == optuna.study.StudyDirection.MINIMIZE:
            x, y = -x, -y
        if x < y:
            return False
        better = better or x > y
    return better


def _fits(value: Any, dist: BaseDistribution) -> bool:
    if isinstance(dist, CategoricalDistribution):
        return value in dist.choices
    if isinstance(dist, (IntDistribution, FloatDistribution)):
        return isinstance(value, (int, float)) and dist.low <= value <= dist.high
    return False
