"""erase-tune's default sampler: one change at a time to a plan on the feasible Pareto front.

Replayed studies on plans measured on an H200 (docs/benchmarks.md, "Tuner efficiency")
showed why Optuna's general-purpose samplers are slow here: a good ERASE plan is a small
edit of another good plan (place one more subarch, detach one, move one to another stream),
while TPE, NSGA-II and GP spend their first dozens of trials learning what a neighbourhood
is. :class:`FrontSampler` searches the neighbourhood directly. After ``n_startup_trials``
complete trials (the enqueued seeds count), its candidates are every plan one change away
from a trial on the Pareto front of the trials within the NE budget (Optuna's
``constraints``): one categorical to another choice, or one number to a random draw, never
a parameter set a trial already had (a repeat is answered from the earlier measurement and
adds nothing). Which candidate is tried is chosen by Thompson sampling on an additive model:
each objective and constraint is a Bayesian linear regression on one indicator per choice
(placing subarch 2 on a side stream, detaching subarch 4, ...), one posterior draw predicts
every candidate, and the candidate whose predicted point adds the most hypervolume to the
feasible front (predicted within the budget) is taken; while none adds any, a uniform one.
Early on the draws are nearly prior noise, so it explores; as trials come in, it learns which
changes pay. Parameters a candidate lacks (the space is conditional) are drawn at random,
and with probability ``restart`` a whole trial is drawn at random, which keeps the search
from settling on one region. Only Optuna's public sampler interface is used.
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

    def __init__(self, *, seed: int | None = None, n_startup_trials: int = 2, restart: float = 0.1,
                 tries: int = 20) -> None:
        self._tries = tries
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
        conditional) is left out and drawn at random later. Among all such neighbours the
        one :func:`_choose` prefers is taken; None (a random trial) when there is none."""
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
        return _choose(list(out.values()), study, self._rng)

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


def _choose(candidates: list[dict[str, Any]], study: optuna.Study, rng: np.random.RandomState) -> dict[str, Any]:
    """The candidate with the largest hypervolume gain under one posterior draw of an additive
    model of each objective and constraint (Thompson sampling); a uniform choice while no
    candidate gains anything under the draw, or when the study has not two objectives."""
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.values is not None]
    if len(study.directions) != 2 or len(done) < 2:
        return candidates[rng.randint(len(candidates))]
    dists: dict[str, BaseDistribution] = {}
    for t in done:
        dists.update(t.distributions)
    columns: dict[tuple, int] = {}
    for params in [t.params for t in done] + candidates:
        for key in _features(params, dists):
            columns.setdefault(key, len(columns))

    def matrix(rows: list[dict[str, Any]]) -> np.ndarray:
        x = np.zeros((len(rows), len(columns) + 1))
        x[:, -1] = 1.0  # intercept
        for i, params in enumerate(rows):
            for key, v in _features(params, dists).items():
                x[i, columns[key]] = v
        return x

    seen_x, cand_x = matrix([t.params for t in done]), matrix(candidates)
    # Objectives turned to "larger is better", then each constraint (feasible: <= 0).
    signs = [1.0 if d == optuna.study.StudyDirection.MAXIMIZE else -1.0 for d in study.directions]
    objectives = np.array([[s * v for s, v in zip(signs, t.values)] for t in done])
    n_con = min((len(t.constraints) for t in done), default=0)
    cons = np.array([list(t.constraints.values())[:n_con] for t in done]).reshape(len(done), n_con)
    pred_obj = np.stack([_draw(seen_x, objectives[:, k], cand_x, rng) for k in range(2)], axis=1)
    pred_con = np.stack([_draw(seen_x, cons[:, k], cand_x, rng) for k in range(n_con)], axis=1) \
        if n_con else np.zeros((len(candidates), 0))
    feasible = (cons <= 0).all(axis=1) if n_con else np.ones(len(done), bool)
    points = objectives[feasible] if feasible.any() else objectives
    ref = points.min(axis=0)
    base = _hv2(points, ref)
    gains = np.array([_hv2(np.vstack([points, p]), ref) - base if (c <= 0).all() else 0.0
                      for p, c in zip(pred_obj, pred_con)])
    best = np.flatnonzero(gains >= gains.max())
    if gains.max() <= 0:
        best = np.arange(len(candidates))
    return candidates[best[rng.randint(len(best))]]


def _features(params: dict[str, Any], dists: dict[str, BaseDistribution]) -> dict[tuple, float]:
    """One indicator per choice of a categorical (or small integer) parameter; a number in
    [0, 1] for a continuous one. A parameter a plan lacks adds nothing."""
    out: dict[tuple, float] = {}
    for name, value in params.items():
        dist = dists.get(name)
        if isinstance(dist, CategoricalDistribution) or (isinstance(dist, IntDistribution) and not dist.log
                                                          and dist.high - dist.low <= 16):
            out[(name, repr(value))] = 1.0
        elif isinstance(dist, (IntDistribution, FloatDistribution)) and dist.high > dist.low:
            lo, hi, v = float(dist.low), float(dist.high), float(value)
            if dist.log:
                lo, hi, v = np.log(lo), np.log(hi), np.log(v)
            out[(name,)] = (v - lo) / (hi - lo)
    return out


def _draw(x: np.ndarray, y: np.ndarray, at: np.ndarray, rng: np.random.RandomState, noise: float = 0.1) -> np.ndarray:
    """Predictions at ``at`` of one posterior draw of Bayesian linear regression of ``y`` on
    ``x`` (``y`` standardised; unit prior on each weight; ``noise``: residual variance)."""
    mean, scale = float(y.mean()), float(y.std()) or 1.0
    z = (y - mean) / scale
    precision = x.T @ x / noise + np.eye(x.shape[1])
    cov = np.linalg.inv(precision)
    w_mean = cov @ x.T @ z / noise
    w = w_mean + np.linalg.cholesky((cov + cov.T) / 2 + 1e-12 * np.eye(len(cov))) @ rng.standard_normal(len(cov))
    return mean + scale * (at @ w)


def _hv2(points: np.ndarray, ref: np.ndarray) -> float:
    """Area dominated by ``points`` (both coordinates larger is better) above ``ref``."""
    useful = sorted((tuple(p) for p in points if p[0] > ref[0] and p[1] > ref[1]), key=lambda p: (-p[0], -p[1]))
    area, top = 0.0, ref[1]
    for a, b in useful:
        if b > top:
            area += (a - ref[0]) * (b - top)
            top = b
    return area
