"""The Optuna side: one multi-objective study per job, stored in SQL.

Objectives are ``qps_gain`` (maximize: p90 QPS gain over the eager baseline) and ``ne_gap``
(minimize: relative NE gap); their names are set on the study so optuna-dashboard labels
them. The NE budget is a constraint (``ne_gap - max_ne_gap <= 0``) set on each trial, which
TPE, NSGA-II and GP honour. What each trial measured is kept in its user attrs under the names
below, so ``status``, ``export`` and the dashboard read one source.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from erase_tune.errors import EraseTuneError
from erase_tune.store import redact_url
from erase_tune.store.engine import one_line, parse_url

__all__ = [
    "METRIC_NAMES",
    "DIRECTIONS",
    "Attr",
    "set_ne_constraint",
    "make_sampler",
    "open_study",
    "load_study",
    "objective_values",
    "pareto_front",
    "FrontPoint",
]

METRIC_NAMES = ("qps_gain", "ne_gap")
DIRECTIONS = ("maximize", "minimize")


class Attr:
    """User-attr names on trials and studies (one place, so readers and writers agree)."""

    PLAN = "plan"  # the canonical plan, as a dict
    PLAN_KEY = "plan_key"  # canonical YAML, to spot repeats
    METRICS = "metrics"  # flat numbers: QPS of each variant, NE, gains
    NE_GAP = "ne_gap"
    MAX_NE_GAP = "max_ne_gap"
    FAILURE = "failure_reason"
    DEVICE = "device"
    NODE = "ray_node"
    GPU = "gpu_ids"
    DURATION = "duration_s"
    PROVENANCE = "provenance"
    DUPLICATE_OF = "duplicate_of"
    HEARTBEAT = "heartbeat"
    SEED_NAME = "seed_name"
    # study-level
    WORKLOAD = "workload"
    SPACE = "space"
    GAIN_OVER = "gain_over"


def set_ne_constraint(trial: optuna.Trial, ne_gap: float, max_ne_gap: float) -> None:
    """Mark the trial feasible (<= 0) when its NE gap is within the job's budget.

    Optuna 5 reads constraints set on the trial itself (``constraints_func`` is deprecated);
    TPE, NSGA-II and GP then prefer feasible trials.
    """
    trial.set_constraint(Attr.NE_GAP, float(ne_gap) - float(max_ne_gap))


def make_sampler(name: str, seed: int | None) -> optuna.samplers.BaseSampler:
    """TPE (default), NSGA-II, GP or random; the first three honour the NE constraint."""
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                          n_startup_trials=8)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise EraseTuneError(f"sampler: {name!r} is not one of tpe, nsga2, gp, random")


def rdb_storage(url: str, *, must_exist: bool = False) -> optuna.storages.RDBStorage:
    """Optuna's storage on ``url``; with ``must_exist``, a SQLite file that is not there is an
    error (a reader with a typo in the path must not create an empty database)."""
    parsed = parse_url(url)  # one line for a bad or unsupported URL, password masked
    if must_exist and parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        if not Path(parsed.database).is_file():
            raise EraseTuneError(f"storage {redact_url(url)}: no database file at {parsed.database}")
    kwargs: dict[str, Any] = {}
    if not url.startswith("sqlite"):
        kwargs["pool_pre_ping"] = True
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
    except Exception as e:  # noqa: BLE001 - any driver/connection error becomes one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = one_line(first.replace(url, redact_url(url)), parsed)  # and no secret the driver quoted
        raise EraseTuneError(f"storage {redact_url(url)}: cannot open: {first}") from None


def open_study(url: str, study_name: str, *, sampler: optuna.samplers.BaseSampler) -> optuna.Study:
    """Create the job's study, or load it to resume; objective names are set either way."""
    storage = rdb_storage(url)
    study = optuna.create_study(storage=storage, study_name=study_name, sampler=sampler,
                                directions=list(DIRECTIONS), load_if_exists=True)
    if [d.name.lower() for d in study.directions] != list(DIRECTIONS):
        raise EraseTuneError(f"study {study_name!r} exists with other objectives; choose another study name")
    if study.metric_names != list(METRIC_NAMES):
        study.set_metric_names(list(METRIC_NAMES))
    return study


def load_study(url: str, study_name: str | None) -> optuna.Study:
    """An existing study; without a name, the only study in the storage."""
    storage = rdb_storage(url, must_exist=True)
    names = [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    if study_name is None:
        if len(names) != 1:
            listed = ", ".join(names) if names else "none"
            raise EraseTuneError(f"--study is needed: {redact_url(url)} holds {len(names)} studies ({listed})")
        study_name = names[0]
    if study_name not in names:
        listed = ", ".join(names) if names else "none"
        raise EraseTuneError(f"no study named {study_name!r} in {redact_url(url)} (studies: {listed})")
    return optuna.load_study(study_name=study_name, storage=storage)


def objective_values(metrics: dict[str, Any], gain_over: str = "eager") -> list[float]:
    """``[qps_gain, ne_gap]`` of a trial's metrics; ``gain_over`` picks the baseline."""
    gain = metrics["gain_p90"] if gain_over == "eager" else metrics.get("gain_vs_reference")
    if gain is None:
        raise EraseTuneError("no whole-step-graph baseline was measured (CPU trial?): gain_over: graph needs CUDA")
    return [float(gain), float(metrics["ne_gap"])]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrontPoint:
    """One Pareto-optimal trial."""

    number: int
    qps_gain: float
    """The study's objective: gain over the baseline the job's ``gain_over`` names."""
    ne_gap: float
    gain_vs_eager: float | None
    gain_vs_reference: float | None
    gain_detach_only: float | None
    plan: dict[str, Any]
    user_attrs: dict[str, Any]


def pareto_front(study: optuna.Study, max_ne_gap: float | None = None) -> list[FrontPoint]:
    """Complete, non-duplicate trials not dominated in (max qps_gain, min ne_gap), best gain
    first; with ``max_ne_gap``, only trials within that NE gap take part."""
    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
              if t.values is not None and Attr.PLAN in t.user_attrs and Attr.DUPLICATE_OF not in t.user_attrs]
    if max_ne_gap is not None:
        trials = [t for t in trials if t.values[1] <= max_ne_gap]
    front = [
        t for t in trials
        if not any(o.values[0] >= t.values[0] and o.values[1] <= t.values[1] and o.values != t.values for o in trials)
    ]
    seen, points = set(), []
    for t in sorted(front, key=lambda t: (-t.values[0], t.values[1], t.number)):
        if tuple(t.values) in seen:
            continue
        seen.add(tuple(t.values))
        m = t.user_attrs.get(Attr.METRICS, {})
        points.append(FrontPoint(number=t.number, qps_gain=t.values[0], ne_gap=t.values[1],
                                 gain_vs_eager=m.get("gain_p90"), gain_vs_reference=m.get("gain_vs_reference"),
                                 gain_detach_only=m.get("gain_detach_only"),
                                 plan=t.user_attrs[Attr.PLAN], user_attrs=dict(t.user_attrs)))
    return points
