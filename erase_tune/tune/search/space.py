"""Search spaces: which plans a study may propose, read from ``search_spaces/*.yaml``.

A space names a workload and says which cut candidates may be detached, how many side
streams there are, which dispatch modes, per-cut and whole-step CUDA graphs, the aux-weight
range, FUP, the objectives, the NE-gap budget, the sampler, the per-trial budget and the
seed plans enqueued first. It is validated at load (:mod:`erase_tune.tune.search.space_file`
reads the file into typed sections; :class:`SearchSpace` is built from them); every error names
the file and field.

Each candidate gets one choice among keep / place on a side stream / detach on a stream /
graph; which of them a candidate is offered is the space's ``modes``, or the candidate's own
(``{module: top_l, modes: [keep, place, graph]}``). The codec between Optuna parameters and
plans is :class:`erase_tune.tune.search.codec.BoundSpace`, made once by
:func:`erase_tune.tune.search.checks.check_space` (``BoundSpace.unchecked`` binds a space to
known candidates without its model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from erase_tune.runtime import ErasePlan
from erase_tune.measure.trial import Budget
from erase_tune.tune.search import space_file
from erase_tune.tune.search.space_file import MODES, SpaceError, SpaceFile

__all__ = ["SearchSpace", "SpaceError", "MODES"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """A validated search space (see the module docstring)."""

    source: str
    """The file it was read from (for messages)."""
    workload: str
    """Built-in workload name or ``package.module:factory``."""
    workload_args: Mapping[str, Any]
    candidates: tuple[str, ...]
    """Modules (or runs) a plan may place, detach or graph; empty = the workload's own candidates."""
    modes: tuple[str, ...]
    """Choices per candidate among :data:`MODES`, for a candidate without its own."""
    max_streams: int
    """Side streams available; a detached cut's or a graphed piece's stream is searched in
    0..max_streams, a placement's in 1..max_streams (with ``streams: searched``)."""
    streams: str
    """``searched`` or ``round_robin`` (candidate i on side stream 1 + i % max_streams)."""
    dispatch: tuple[str, ...]
    graph: tuple[bool, ...]
    """Choices of the per-cut CUDA-graph flag."""
    whole_step_graph: tuple[bool, ...]
    find_unused_parameters: tuple[bool, ...]
    aux_weight: tuple[float, float, bool]
    """(low, high, log) of each detached cut's λ."""
    max_ne_gap: float
    """Constraint: trials with a larger relative NE gap are infeasible."""
    gain_over: str
    """Which baseline ``qps_gain`` is measured against: ``eager`` or ``graph`` (GAIN_OVER)."""
    sampler: str
    sampler_seed: int | None
    budget: Budget
    """Per-trial budget (steps, windows; its seed is the space's ``seed``)."""
    timeout_s: float
    """A trial running longer is cancelled and recorded as failed."""
    trials: int
    """Default number of trials a job runs."""
    seed: int
    """Seed of weights and data in every trial (so trials are comparable)."""
    device: str
    seeds: tuple[tuple[str, ErasePlan], ...]
    """(name, plan) pairs enqueued before the sampler proposes anything."""
    working_dir: str | None = None
    """A directory shipped to the Ray workers (the workload's code), resolved against the file."""
    py_modules: tuple[str, ...] = ()
    """Package directories shipped to the Ray workers, resolved against the file."""
    gpus_per_trial: int = 1
    """Ranks of one trial (1..64): k > 1 runs k data-parallel ranks on one node (one GPU each,
    or one CPU each with ``device: cpu``), every variant's gradients averaged across them."""
    text: str = ""
    """The file's text, as given (stored with the job)."""
    candidate_modes: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """A candidate's own choices among :data:`MODES`, where its entry gives them
    (``{module: top_l, modes: [keep, graph]}``); the others take :attr:`modes`."""
    screen: bool = True
    """``sampler.screen``: measure each single structural change, then unions of those that
    gained, before the sampler proposes (erase_tune.tune.search.screen)."""

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> SearchSpace:
        return cls.from_file(space_file.read(path))

    @classmethod
    def loads(cls, text: str, source: str = "<space>", base: Path | None = None) -> SearchSpace:
        """Parse a space; relative paths in it are resolved against ``base``."""
        return cls.from_file(space_file.loads(text, source, base))

    @classmethod
    def from_file(cls, f: SpaceFile) -> SearchSpace:
        """The space a checked file describes."""
        cuts = f.cuts
        return cls(
            source=f.source, text=f.text,
            workload=f.workload.name, workload_args=dict(f.workload.args), working_dir=f.workload.working_dir,
            py_modules=f.workload.py_modules,
            candidates=tuple(c.module for c in cuts.candidates), modes=cuts.modes,
            candidate_modes={c.module: c.modes for c in cuts.candidates if c.modes is not None},
            max_streams=cuts.max_streams, streams=cuts.streams, dispatch=cuts.dispatch, graph=cuts.graph,
            whole_step_graph=cuts.whole_step_graph, find_unused_parameters=cuts.find_unused_parameters,
            aux_weight=(cuts.aux_weight.low, cuts.aux_weight.high, cuts.aux_weight.log),
            max_ne_gap=f.max_ne_gap, gain_over=f.gain_over, sampler=f.sampler.name, sampler_seed=f.sampler.seed,
            screen=f.sampler.screen,
            budget=f.budget.per_trial, timeout_s=f.budget.timeout_s, trials=f.trials, seed=f.seed, device=f.device,
            seeds=tuple((s.name, s.plan) for s in f.seeds), gpus_per_trial=f.gpus_per_trial,
        )

    # -- the candidates' modes ----------------------------------------------------------------

    @property
    def may_detach(self) -> bool:
        """Whether a plan of this space can detach anything (the workload's own candidates
        take :attr:`modes`)."""
        return "detach" in self.modes or any("detach" in m for m in self.candidate_modes.values())

    def modes_of(self, candidate: str) -> tuple[str, ...]:
        """The choices a plan of this space has for ``candidate``: its own, else :attr:`modes`
        (a bound space resolves them so for each of its candidates: ``BoundSpace.modes``)."""
        return self.candidate_modes.get(candidate, self.modes)
