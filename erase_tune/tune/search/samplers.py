"""erase-tune's default sampler: one change at a time, remembering what each change did.

Replayed studies on plans measured on an H200 (docs/benchmarks.md, "Tuner efficiency")
showed why Optuna's general-purpose samplers are slow here: a good ERASE plan is a small
edit of another good plan (place one more subarch, detach one, move one to another stream),
while TPE, NSGA-II and GP spend their first dozens of trials learning what a neighbourhood
is. :class:`FrontSampler` searches the neighbourhood directly, and learns from its own moves:

- A **move** is one categorical parameter changed from one choice to another
  (``subarchs.2.mode: place -> detach``). Two measured trials whose common parameters differ
  in that one parameter only are a measurement of the move's *effect*: the difference of
  their objective values (parameters that appear or vanish with the change, as the space is
  conditional, do not count as differences). Effects are averaged over every such pair, in
  whatever plans they were seen, and the reverse move has the negated effect.
- Candidates are the plans one move away from a measured trial, never a plan a trial already
  had (a repeat is answered from the earlier measurement and adds nothing). Different
  parameters can make the same plan (streams are renumbered in a plan's canonical form, a
  parameter may not matter under another's choice): given ``plan_key`` ((parameters, rng) ->
  (the canonical plan, the parameters that make it, those a change makes appear drawn with
  ``rng``); erase_tune.tune.search.codec.BoundSpace.key), plans are told apart by it, and a repeat of a plan
  is neither a candidate nor a measurement of a move.
- **Exploit**: a candidate whose move has a known effect is predicted as its parent's values
  plus that effect; if any prediction adds hypervolume to the feasible front (reference
  point: QPS gain 0, NE gap = the budget), the best such candidate is proposed. This is how
  good moves found separately get combined.
- **Explore**: otherwise, uniformly, one of the candidates one *unmeasured* move away from a
  trial on the feasible Pareto front (a number is changed by a fresh random draw, which is
  never a known move).
- A whole trial is drawn at random when there is neither, and with probability ``restart``
  at any time, which keeps the search from settling on one region.

Without ``plan_key``, parameters a change makes appear are drawn at random when asked. Only Optuna's public sampler interface
is used. In the replay (100 seeds × 3) the memory of moves brought the mean hypervolume
curve to random search's 60-trial value after 18–20 trials, against 25–27 for uniform
one-change moves without it; a model of the objectives (additive in the choices, fitted by
least squares, greedy or Thompson-sampled) did worse than both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler, RandomSampler
from optuna.trial import FrozenTrial, TrialState

from erase_tune.tune.search.hypervolume import hypervolume

__all__ = ["FrontSampler"]

Move = tuple[str, Any, Any]
"""(parameter, from choice, to choice)."""


class FrontSampler(BaseSampler):
    """Known-good moves first, then unmeasured moves from the feasible front (module docstring).

    ``max_ne_gap`` is the budget, the NE-gap end of the hypervolume's reference point; without
    it, the budget is read from the trials' constraints (``ne_gap - max_ne_gap``, as the driver
    writes them), or the largest NE gap measured. ``plan_key`` names the plan a parameter set
    makes (see the module docstring); without it, parameter sets are plans."""

    def __init__(self, *, seed: int | None = None, n_startup_trials: int = 2, restart: float = 0.1,
                 max_ne_gap: float | None = None,
                 plan_key: Callable[[dict[str, Any], Any], tuple[Any, dict[str, Any]]] | None = None) -> None:
        self._rng = np.random.RandomState(seed)
        self._random = RandomSampler(seed=seed)
        self._n_startup = n_startup_trials
        self._restart = restart
        self._budget = max_ne_gap
        self._plan_key = plan_key
        self._plan_of: dict[frozenset, tuple[Any, dict[str, Any]]] = {}  # parameter set -> _plan
        self._plans: dict[int, dict[str, Any] | None] = {}
        self._paired: set[int] = set()  # trial numbers whose pairs are in _sums
        self._sums: dict[Move, tuple[np.ndarray, int]] = {}

    @property
    def max_ne_gap(self) -> float | None:
        """The NE budget the hypervolume is measured within (the driver widens it by the noise
        floor once that is measured)."""
        return self._budget

    @max_ne_gap.setter
    def max_ne_gap(self, value: float | None) -> None:
        self._budget = value

    def reseed_rng(self) -> None:
        self._rng = np.random.RandomState()
        self._random.reseed_rng()

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        done = self._distinct([t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                               if t.values is not None])
        self._learn(done)
        if len(done) < self._n_startup or not done:
            self._plans[trial.number] = None
        elif self._rng.rand() < self._restart:
            self._plans[trial.number] = self._fresh(done, study, trial)
        else:
            self._plans[trial.number] = self._proposal(done, study, trial)

    def _plan(self, params: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The plan ``params`` make and the parameters that make it (what a plan needs and
        ``params`` lack is drawn; one draw per parameter set)."""
        if self._plan_key is None:
            return frozenset(params.items()), params
        ps = frozenset(params.items())
        if ps not in self._plan_of:
            self._plan_of[ps] = self._plan_key(params, self._rng)
        return self._plan_of[ps]

    def _distinct(self, done: list[FrozenTrial]) -> list[FrozenTrial]:
        """The first complete trial of each plan (a repeat was answered with its values)."""
        out, plans = [], set()
        for t in done:
            key = self._plan(t.params)[0]
            if key not in plans:
                out.append(t)
                plans.add(key)
        return out

    def _seen(self, study: optuna.Study) -> set[Any]:
        """The plans of every trial, running ones included, and their parameter sets."""
        seen: set[Any] = set()
        for t in study.get_trials(deepcopy=False):
            seen.add(frozenset(t.params.items()))
            seen.add(self._plan(t.params)[0])
        return seen

    def _new(self, params: dict[str, Any], seen: set[Any]) -> dict[str, Any] | None:
        """The parameters of the plan ``params`` make, completed, if no trial had that plan."""
        if frozenset(params.items()) in seen:
            return None
        key, full = self._plan(params)
        return None if key in seen else full

    # -- what the moves did ----------------------------------------------------------------

    def _learn(self, done: list[FrozenTrial]) -> None:
        """Add the pairs each newly completed trial makes with the earlier ones."""
        known = [t for t in done if t.number in self._paired]
        for t in done:
            if t.number in self._paired:
                continue
            for o in known:
                move = _one_move(o, t)
                if move is not None:
                    self._add(move, np.asarray(t.values, float) - np.asarray(o.values, float))
            self._paired.add(t.number)
            known.append(t)

    def _add(self, move: Move, delta: np.ndarray) -> None:
        for m, d in ((move, delta), ((move[0], move[2], move[1]), -delta)):
            total, n = self._sums.get(m, (np.zeros_like(d), 0))
            self._sums[m] = (total + d, n + 1)

    def _effect(self, move: Move) -> np.ndarray | None:
        if move not in self._sums:
            return None
        total, n = self._sums[move]
        return total / n

    # -- the next plan ---------------------------------------------------------------------

    def _proposal(self, done: list[FrozenTrial], study: optuna.Study, trial: FrozenTrial) -> dict[str, Any] | None:
        budget = self._budget_of(done)
        feasible = [t for t in done if _feasible(t)] or done
        front = {t.number for t in feasible if not any(_dominates(o, t, study) for o in feasible)}
        points = [_point(t.values, study) for t in feasible]
        base = hypervolume(points, budget)
        seen = self._seen(study)
        known: dict[frozenset, tuple[float, dict[str, Any]]] = {}  # predicted to add hypervolume
        unmeasured: dict[frozenset, dict[str, Any]] = {}
        for parent in done:
            for name in sorted(parent.params):
                dist = parent.distributions[name]
                if not isinstance(dist, CategoricalDistribution):
                    if parent.number in front:  # a number: one fresh draw, an unmeasured move
                        params = {**parent.params, name: self._random.sample_independent(study, trial, name, dist)}
                        unmeasured.setdefault(frozenset(params.items()), params)
                    continue
                for value in dist.choices:
                    if value == parent.params[name]:
                        continue
                    params = {**parent.params, name: value}
                    key = frozenset(params.items())
                    if key in seen:
                        continue
                    effect = self._effect((name, parent.params[name], value))
                    if effect is None:
                        if parent.number in front:
                            unmeasured.setdefault(key, params)
                        continue
                    predicted = _point(np.asarray(parent.values, float) + effect, study)
                    gain = hypervolume([*points, predicted], budget) - base
                    if gain > 0 and gain > known.get(key, (0.0, None))[0]:
                        known[key] = (gain, params)
        # The best new plan predicted to add hypervolume (ties: one at random), else a new plan
        # one unmeasured move from the front, else a fresh draw. Plan keys are computed only
        # here, for the candidates that get that far.
        ranked = sorted(known.values(), key=lambda gp: -gp[0])
        for i, (gain, _) in enumerate(ranked):
            ties = [full for g, p in ranked[i:] if g >= gain and (full := self._new(p, seen)) is not None]
            if ties:
                return ties[self._rng.randint(len(ties))]
        choices = list(unmeasured.values())
        for i in self._rng.permutation(len(choices)):
            if (full := self._new(choices[i], seen)) is not None:
                return full
        return self._fresh(done, study, trial)

    def _fresh(self, done: list[FrozenTrial], study: optuna.Study, trial: FrozenTrial) -> dict[str, Any] | None:
        """A random draw of the parameters of a random measured trial (parameters that appear
        with it are drawn later), not one a trial already had; None after 32 tries."""
        seen = self._seen(study)
        for _ in range(32):
            parent = done[self._rng.randint(len(done))]
            params = {name: self._random.sample_independent(study, trial, name, dist)
                      for name, dist in parent.distributions.items()}
            if (full := self._new(params, seen)) is not None:
                return full
        return None

    def _budget_of(self, done: list[FrozenTrial]) -> float:
        if self._budget is not None:
            return self._budget
        for t in done:  # the driver's constraint is ne_gap - max_ne_gap
            if len(t.constraints) == 1 and len(t.values) == 2:
                return float(t.values[1] - next(iter(t.constraints.values())))
        return max(float(t.values[1]) for t in done) + 1e-12

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        params = self._plans.get(trial.number)
        if params is None or param_name not in params or not _fits(params[param_name], param_distribution):
            return self._random.sample_independent(study, trial, param_name, param_distribution)
        return params[param_name]

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Any) -> None:
        self._plans.pop(trial.number, None)


def _one_move(a: FrozenTrial, b: FrozenTrial) -> Move | None:
    """The move from ``a`` to ``b`` when their common parameters differ in one categorical."""
    diff = [k for k in a.params.keys() & b.params.keys() if a.params[k] != b.params[k]]
    if len(diff) != 1 or not isinstance(a.distributions[diff[0]], CategoricalDistribution):
        return None
    if not all(math.isfinite(v) for v in (*a.values, *b.values)):
        return None
    k = diff[0]
    return k, a.params[k], b.params[k]


def _point(values: Any, study: optuna.Study) -> tuple[float, float]:
    """(maximized, minimized) objective pair as the hypervolume takes it: (QPS gain, NE gap)."""
    v = [float(x) for x in values]
    if study.directions[0] == optuna.study.StudyDirection.MINIMIZE:
        v[0] = -v[0]
    if study.directions[1] == optuna.study.StudyDirection.MAXIMIZE:
        v[1] = -v[1]
    return v[0], v[1]


def _feasible(t: FrozenTrial) -> bool:
    return all(v <= 0 for v in t.constraints.values())


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
