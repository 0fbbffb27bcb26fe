"""A finished erase-tune study, written with Optuna's public API, for the report and dashboard tests.

``write_finished_study`` stores, in a SQLite file, a study laid out exactly as the driver
writes one: directions [maximize, minimize] named ``qps_gain`` and ``ne_gap``; study attrs
``workload``, ``max_ne_gap`` and ``gain_over``; measured trials with flat scalar user attrs
(sortable in the dashboard), the NE budget as Optuna's per-constraint constraint *and* the
``constraints`` system attr optuna-dashboard reads; seeds named by ``seed_name``; a repeat of
a measured plan (``duplicate_of``); and failed trials of both kinds with their reasons.

The numbers are made up but consistent: every QPS figure follows from one eager baseline and
one whole-step-graph reference, so each gain and ``qps_gain`` agree with the QPS they came from.
The expected Pareto front (within the budget) is ``FRONT``.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from erase_tune.runtime import ErasePlan

__all__ = ["STUDY_NAME", "MAX_NE_GAP", "FRONT", "MEASURED", "write_finished_study", "confirm_front"]

STUDY_NAME = "finished"
MAX_NE_GAP = 0.02
BASELINE_QPS = 100_000.0  # eager
REFERENCE_QPS = 125_000.0  # whole-step graph: qps_gain is over this one (gain_over: graph)
SUBARCHS = 3


@dataclasses.dataclass(frozen=True)
class Spec:
    """One trial to write: which cuts (subarch -> (stream, aux_weight)), how it ran, what it measured."""

    cuts: dict[int, tuple[int, float]]
    whole_step_graph: bool = False
    dispatch: str = "blocking"
    gain_vs_eager: float = 0.0
    ne_gap: float = 0.0
    seed_name: str | None = None
    duplicate_of: int | None = None
    failure: tuple[str, str] | None = None  # (failure_kind, failure_reason)


_ALL = {0: (1, 1.0), 1: (2, 1.0), 2: (1, 1.0)}
SPECS: list[Spec] = [
    Spec(cuts={}, gain_vs_eager=0.004, ne_gap=0.0, seed_name="no-cuts"),                                        # 0
    Spec(cuts=_ALL, dispatch="threaded", gain_vs_eager=0.60, ne_gap=0.0736, seed_name="paper"),                  # 1
    Spec(cuts=_ALL, whole_step_graph=True, gain_vs_eager=0.62, ne_gap=0.0736, seed_name="whole-step-graph-all"),  # 2
    Spec(cuts={1: (0, 0.3)}, gain_vs_eager=0.35, ne_gap=0.004),                                                  # 3
    Spec(cuts={0: (1, 0.5), 2: (2, 0.2)}, whole_step_graph=True, gain_vs_eager=0.72, ne_gap=0.012),              # 4
    Spec(cuts={0: (1, 2.5), 1: (2, 2.0), 2: (0, 1.5)}, whole_step_graph=True, gain_vs_eager=0.95, ne_gap=0.031),  # 5
    Spec(cuts={2: (0, 0.15)}, dispatch="threaded", gain_vs_eager=-0.05, ne_gap=-0.003),                          # 6
    Spec(cuts={0: (2, 0.4), 1: (1, 0.6)}, whole_step_graph=True, gain_vs_eager=0.80, ne_gap=0.015),              # 7
    Spec(cuts={0: (2, 0.4), 1: (1, 0.6)}, whole_step_graph=True, gain_vs_eager=0.80, ne_gap=0.015,
         duplicate_of=7),                                                                                        # 8
    Spec(cuts={0: (1, 0.2), 1: (1, 0.2), 2: (1, 0.2)}, dispatch="threaded",
         failure=("trial", "candidate: CUDA out of memory (tried to allocate 2.00 GiB)")),                      # 9
    Spec(cuts={1: (1, 0.25)}, whole_step_graph=True, gain_vs_eager=0.41, ne_gap=-0.0077),                        # 10
    Spec(cuts={2: (2, 0.8)}, failure=("infra", "Ray worker died: node 127.0.0.1 lost")),                         # 11
    Spec(cuts={0: (1, 0.7), 1: (2, 1.2), 2: (2, 0.5)}, whole_step_graph=True, gain_vs_eager=0.88, ne_gap=0.019),  # 12
    Spec(cuts={0: (0, 0.3), 2: (1, 0.3)}, whole_step_graph=True, gain_vs_eager=0.66, ne_gap=0.002),              # 13
    Spec(cuts={0: (0, 0.12)}, gain_vs_eager=0.20, ne_gap=0.0005),                                               # 14
    Spec(cuts={0: (2, 2.8), 2: (2, 2.2)}, dispatch="threaded", gain_vs_eager=0.55, ne_gap=0.041),                # 15
    Spec(cuts={1: (2, 0.35), 2: (1, 0.3)}, whole_step_graph=True, gain_vs_eager=0.75, ne_gap=-0.002),            # 16
    Spec(cuts={1: (0, 0.5)}, dispatch="threaded", gain_vs_eager=0.10, ne_gap=0.006),                            # 17
]

FRONT = [12, 7, 16, 10]
"""Trial numbers of the Pareto front within the budget, largest gain first."""
MEASURED = [i for i, s in enumerate(SPECS) if s.failure is None and s.duplicate_of is None]


def _params(spec: Spec) -> tuple[dict[str, Any], dict[str, optuna.distributions.BaseDistribution]]:
    """The trial's parameters as the driver's space suggests them: a cut's stream and weight
    exist only when it is on, dispatch only without a whole-step graph (a conditional space)."""
    params: dict[str, Any] = {"whole_step_graph": spec.whole_step_graph}
    dists: dict[str, optuna.distributions.BaseDistribution] = {
        "whole_step_graph": CategoricalDistribution([False, True])}
    for i in range(SUBARCHS):
        on = i in spec.cuts
        params[f"subarchs.{i}.detach"] = on
        dists[f"subarchs.{i}.detach"] = CategoricalDistribution([False, True])
        if on:
            stream, weight = spec.cuts[i]
            params[f"subarchs.{i}.stream"] = stream
            dists[f"subarchs.{i}.stream"] = IntDistribution(0, 2)
            params[f"subarchs.{i}.aux_weight"] = weight
            dists[f"subarchs.{i}.aux_weight"] = FloatDistribution(0.1, 3.0, log=True)
    if not spec.whole_step_graph:
        params["dispatch"] = spec.dispatch
        dists["dispatch"] = CategoricalDistribution(["blocking", "threaded"])
    return params, dists


def _plan(spec: Spec) -> ErasePlan:
    cuts = [{"module": f"subarchs.{i}", "stream": s, "aux_weight": w, "graph": False}
            for i, (s, w) in sorted(spec.cuts.items())]
    streams = max((s for s, _ in spec.cuts.values()), default=0)
    return ErasePlan.from_dict({"version": 1, "num_streams": streams, "dispatch": spec.dispatch,
                                "whole_step_graph": spec.whole_step_graph, "cuts": cuts})


def _measured_attrs(number: int, spec: Spec, gain_over: str) -> tuple[list[float], dict[str, Any]]:
    candidate = BASELINE_QPS * (1 + spec.gain_vs_eager)
    gain_vs_graph = candidate / REFERENCE_QPS - 1
    qps_gain = gain_vs_graph if gain_over == "graph" else spec.gain_vs_eager
    # per-window spread: wider for the threaded plans, as on a real GPU
    half = 0.08 if spec.dispatch == "threaded" and not spec.whole_step_graph else 0.03
    ne_baseline = 0.7874
    attrs: dict[str, Any] = {
        "gain_vs_eager": spec.gain_vs_eager,
        "gain_vs_graph": gain_vs_graph,
        "gain_detach_only": spec.gain_vs_eager * 0.85 if spec.cuts else None,
        "gain_median": spec.gain_vs_eager + 0.01,
        "gain_lo": spec.gain_vs_eager - half,
        "gain_hi": spec.gain_vs_eager + half * 1.5,
        "ne_baseline": ne_baseline,
        "ne_candidate": ne_baseline * (1 + spec.ne_gap),
        "ne_gap": spec.ne_gap,
        "max_ne_gap": MAX_NE_GAP,
        "feasible": spec.ne_gap <= MAX_NE_GAP,
        "baseline_p90_qps": BASELINE_QPS,
        "candidate_p90_qps": candidate,
        "reference_p90_qps": REFERENCE_QPS,
        "detach_only_p90_qps": BASELINE_QPS * (1 + spec.gain_vs_eager * 0.85) if spec.cuts else None,
        "device": "NVIDIA H200",
        "ray_node": "127.0.0.1/0a1b2c",
        "duration_s": 14.0 + number,
        "attempts": 1,
    }
    return [qps_gain, spec.ne_gap], {k: v for k, v in attrs.items() if v is not None}


_WRITTEN: dict[tuple[str, str, int | None], Path] = {}
"""Each study written once per process, copied for every test that asks for it (writing one
takes half a second of CPU, and several test modules write dozens)."""


def write_finished_study(path: Path, *, gain_over: str = "graph", study_name: str = STUDY_NAME,
                         first: int | None = None) -> str:
    """Write the study to the SQLite file ``path``; returns its storage URL. ``first`` keeps
    only the first trials of ``SPECS``: a smaller job (the numbering, and so ``duplicate_of``,
    stays right). A file that exists already gets the study added beside those it holds."""
    if Path(path).exists():
        _write_study(path, gain_over=gain_over, study_name=study_name, first=first)
        return f"sqlite:///{path}"
    key = (gain_over, study_name, first)
    written = _WRITTEN.get(key)
    if written is None or not written.is_file():
        written = Path(tempfile.mkdtemp(prefix="erase-tune-study-")) / "study.db"
        _write_study(written, gain_over=gain_over, study_name=study_name, first=first)
        _WRITTEN[key] = written
    shutil.copyfile(written, path)
    return f"sqlite:///{path}"


def _write_study(path: Path, *, gain_over: str, study_name: str, first: int | None) -> None:
    url = f"sqlite:///{path}"
    study = optuna.create_study(storage=url, study_name=study_name, directions=["maximize", "minimize"])
    with warnings.catch_warnings():  # experimental in Optuna 5, and what the driver calls too
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(["qps_gain", "ne_gap"])
    study.set_user_attr("workload", {"name": "ctr", "args": {"batch": 2048, "width": 256}})
    study.set_user_attr("max_ne_gap", MAX_NE_GAP)
    study.set_user_attr("gain_over", gain_over)
    specs = SPECS if first is None else SPECS[:first]
    for number, spec in enumerate(specs):
        params, dists = _params(spec)
        plan = _plan(spec)
        attrs: dict[str, Any] = {"plan": plan.to_dict(), "plan_summary": plan.describe()}
        if spec.seed_name:
            attrs["seed_name"] = spec.seed_name
        if spec.failure is not None:
            kind, reason = spec.failure
            attrs.update(failure_kind=kind, failure_reason=reason, attempts=2 if kind == "infra" else 1)
            study.add_trial(optuna.trial.create_trial(state=TrialState.FAIL, params=params, distributions=dists,
                                                      user_attrs=attrs))
            continue
        values, measured = _measured_attrs(number, spec, gain_over)
        attrs.update(measured)
        if spec.duplicate_of is not None:
            attrs["duplicate_of"] = spec.duplicate_of
        slack = spec.ne_gap - MAX_NE_GAP
        study.add_trial(optuna.trial.create_trial(
            state=TrialState.COMPLETE, values=values, params=params, distributions=dists, user_attrs=attrs,
            system_attrs={"constraints": [slack]}, constraints={"ne_gap": slack}))


def confirm_front(db: Any, study_name: str, space_path: str, space_yaml: str) -> None:
    """A finished job for the study written by :func:`write_finished_study`, with a speed and a
    quality confirmation for each plan of :data:`FRONT` (so export writes without Ray)."""
    from erase_tune.store import ConfirmationRecord, QualityRecord

    job = db.store.create_job(study_name=study_name, space_path=space_path, space_yaml=space_yaml,
                              workload="ctr", n_trials_target=18)
    db.store.set_job_status(study_name, "finished")
    study = optuna.load_study(study_name=study_name, storage=db.optuna)
    for n in FRONT:
        plan = ErasePlan.from_dict(study.trials[n].user_attrs["plan"])
        db.store.record_confirmation(job, n, ConfirmationRecord(
            plan_yaml=plan.dumps(), gain_over="eager", windows=5, gain=0.1, gain_lo=0.05, gain_hi=0.15,
            samples={}, provenance={}))
        db.store.record_quality(job, n, QualityRecord(
            plan_yaml=plan.dumps(), steps=100, seeds=3, ne_gap=0.001, ne_gap_lo=-0.002, ne_gap_hi=0.004,
            per_seed=[0.0, 0.001, 0.002], exact=not plan.cuts, band=0.002, provenance={}))
