"""``erase-tune report``: a finished job as one HTML page (and its PNGs) that can be mailed.

The page holds the Pareto front of QPS gain against NE gap, the structural screen's trials
(erase_tune.tune.search.screen) and each trial's phase, the hypervolume within the NE budget
trial by trial, each trial's QPS spread over timing windows, the parameters that
decide the gain, the front as a table and the job's facts (workload, budget, baseline,
trial counts, failures and why). Figures are embedded as ``data:`` URIs so the one file is
the whole report; the PNGs are written beside it too. Nothing on the page depends on when
it was made (no timestamps, sorted keys), so a regenerated report diffs cleanly.

Trials are read in the current layout (flat scalar user attrs: ``gain_vs_eager``,
``gain_vs_graph``, ``gain_lo``, ...) and in the older one, which nested the numbers in a
``metrics`` user attr under partly different names (read through ``study.flat_attrs``).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import optuna

from erase_tune.errors import EraseTuneError, one_line
from erase_tune.store import default_storage_url
from erase_tune.store.storage import open_storage
from erase_tune.tune.search.screen import SINGLE, UNION
from erase_tune.tune.search.study import load_study
from erase_tune.tune.search.hypervolume import hypervolume_history
from erase_tune.tune.views.report_data import (
    Importance,
    StudyFacts,
    TrialRecord,
    front_within_budget,
    param_importance,
    read_records,
    study_facts,
)

__all__ = ["ReportFiles", "write_report", "report"]

_FILES = {"html": "report.html", "pareto_front": "pareto_front.png", "hypervolume": "hypervolume.png",
          "qps_spread": "qps_spread.png", "importance": "param_importance.png"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReportFiles:
    """What ``write_report`` wrote."""

    html: Path
    pareto_front: Path
    hypervolume: Path
    qps_spread: Path
    importance: Path | None
    """None when importance could not be assessed (the page says why)."""

    @property
    def pngs(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.pareto_front, self.hypervolume, self.qps_spread, self.importance)
                     if p is not None)


# -- writing ------------------------------------------------------------------------------------


def _check_out_dir(out_dir: str | Path) -> Path:
    """``out_dir`` if it is, or can be created as, a directory; one line if not. Nothing is
    created: a report refused later (no such study) leaves no empty directory behind."""
    path = Path(out_dir)
    shown = one_line(str(path), 300)
    if "\0" in str(path):
        raise EraseTuneError(f"report directory {shown}: not a directory name (it holds a NUL)")
    try:
        if path.exists() and not path.is_dir():
            raise EraseTuneError(f"report directory {shown} is not a directory")
        existing = path.absolute()
        while not existing.exists():
            existing = existing.parent
    except OSError as e:  # a name too long for the file system, say
        raise EraseTuneError(f"report directory {shown}: {e.strerror or e}") from None
    if not existing.is_dir():
        raise EraseTuneError(f"report directory {shown}: cannot create it: {existing} is not a directory")
    return path


def _out_dir(out_dir: str | Path) -> Path:
    """``out_dir``, created if missing; one line if it is not a directory or cannot be written."""
    path = _check_out_dir(out_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise EraseTuneError(f"report directory {path}: cannot create it: {e.strerror or e}") from None
    try:  # permission bits do not tell (root, read-only mounts): try it
        fd, probe = tempfile.mkstemp(prefix=".erase-tune-report.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise EraseTuneError(f"report directory {path}: cannot write there: {e.strerror or e}") from None
    return path


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` whole: an interrupted run never leaves half a report behind."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        # mkstemp makes the file private (0600); a report is made to be shared, so give it the
        # mode an ordinary open() would (0666 less the umask)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _pct(x: float | None, sign: bool = True) -> str:
    if x is None:
        return "-"
    return f"{x:+.2%}" if sign else f"{x:.2%}"


def _img(png: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">'


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = ()) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{html.escape(c)}</td>' if i in numeric else f"<td>{html.escape(c)}</td>"
                         for i, c in enumerate(row)) + "</tr>"
        for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
img { max-width: 100%; height: auto; border: 1px solid #eee; }
p.what { color: #444; max-width: 60em; } code { background: #f4f4f4; padding: 0 0.2em; }
"""


def _noise_text(facts: StudyFacts) -> str:
    """The noise floor in words: the band, what it came from, and what it changes."""
    floor = facts.noise_floor
    if not floor:
        return "not measured (feasibility is the budget alone)"
    gaps = ", ".join(f"{k} {_pct(g)}" for k, g in zip(floor.get("kinds") or [], floor.get("gaps") or []))
    return (f"\u00b1{_pct(facts.noise_band, False)}: the baseline trained against itself for "
            f"{floor.get('training_steps')} steps ({gaps}); a plan is over the budget only beyond "
            f"{_pct(facts.max_ne_gap + facts.noise_band, False)}, and a plan with no cuts (exact by construction) "
            "never is: its NE gap is noise")


def _page(facts: StudyFacts, records: Sequence[TrialRecord], front: Sequence[TrialRecord], history: Sequence[float],
          importance: Importance, pngs: dict[str, bytes]) -> str:
    parts = [*_head(facts, records, history), *_front_section(records, front, pngs["pareto_front"]),
             *_screen_section(records), *_figures_section(importance, pngs), *_failed_section(records),
             "</body></html>\n"]
    return "\n".join(parts)


def _head(facts: StudyFacts, records: Sequence[TrialRecord], history: Sequence[float]) -> list[str]:
    """The page's head, what the job searched for, and the study's facts."""
    e = html.escape
    over = facts.gain_over
    budget = facts.max_ne_gap
    workload = facts.workload or {}
    workload_text = (f"{workload.get('name', '?')} {json.dumps(workload.get('args', {}), sort_keys=True)}"
                     if workload else "-")
    counts = ", ".join(f"{n} {state.lower()}" for state, n in facts.counts.items()) or "none"
    final_hv = history[-1] if history else 0.0
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>erase-tune report: {e(facts.study_name)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>erase-tune report: study <code>{e(facts.study_name)}</code></h1>",
        '<p class="what">The job searched ERASE detachment plans for two objectives: <b>qps_gain</b> '
        f"(maximize: the plan's p90 QPS gain over the {e(over)} baseline) and <b>ne_gap</b> (minimize: the relative "
        f"normalized-entropy gap to that baseline's training), with the NE budget <b>ne_gap &le; {_pct(budget, False)}"
        "</b> as a constraint. Gains and gaps are fractions shown as percentages.</p>",
        _table(["fact", "value"], [
            ["workload", workload_text],
            ["NE budget (max_ne_gap)", _pct(budget, False)],
            ["noise floor of the NE gap", _noise_text(facts)],
            ["qps_gain is over", f"the {over} baseline"],
            ["trials by state", counts],
            ["trials by phase", ", ".join(f"{n} {phase}" for phase, n in facts.phases.items()) or "-"],
            ["structural screen (single changes, then unions of those that gained)",
             (facts.screen or "no trial was the screen's").removeprefix("screen: ")],
            ["measured plans", f"{facts.measured} ({facts.feasible} within the NE budget)"],
            ["repeats of a measured plan", f"{facts.duplicates} (left out of fronts and figures)"],
            ["seeds (plans the job measured first)", "; ".join(
                f"{r.seed_name} #{r.number}: " + (f"{_pct(r.qps_gain)} at NE gap {_pct(r.ne_gap)}"
                                                  + ("" if r.feasible else ", over the budget")
                                                  if r.measured else r.state.lower())
                for r in records if r.seed_name) or "-"],
            ["hypervolume within the budget", f"{final_hv * 1e4:.1f} (QPS-gain % \u00d7 NE-gap %)"],
        ]),
    ]
    return parts


def _front_section(records: Sequence[TrialRecord], front: Sequence[TrialRecord], png: bytes) -> list[str]:
    """The Pareto front: its figure and the table of the front within the NE budget."""
    parts = [
        "<h2>Pareto front</h2>",
        '<p class="what">Each dot is a measured plan at its QPS gain and NE gap (the lower panel zooms into the NE '
        "budget); the red ones are the best trade-offs within the budget (no other plan within it is both faster "
        "and closer in NE), the dashed line is the budget, the cross is the baseline and the star the paper's "
        "configuration.</p>",
        _img(png, "Pareto front: qps_gain against ne_gap"),
        "<h3>The front within the NE budget</h3>",
    ]
    if front:
        parts.append(_table(
            ["trial", "qps_gain", "ne_gap", "gain over eager", "gain over graph", "phase", "plan"],
            [[str(r.number), _pct(r.qps_gain), _pct(r.ne_gap), _pct(r.gain_vs_eager), _pct(r.gain_vs_graph),
              r.phase + (f": {r.screen_name}" if r.screen_name else ""),
              r.plan_summary + (f" (seed: {r.seed_name})" if r.seed_name else "")] for r in front],
            numeric=(0, 1, 2, 3, 4)))
    else:
        closest = min((r.ne_gap for r in records if r.measured), default=None)
        parts.append("<p>No measured plan is within the NE budget"
                     + (f" (the smallest NE gap measured is {_pct(closest)})" if closest is not None else "")
                     + ".</p>")
    return parts


def _screen_section(records: Sequence[TrialRecord]) -> list[str]:
    """The structural screen's trials, if it ran."""
    parts: list[str] = []
    screened = [r for r in records if r.phase in (SINGLE, UNION) and r.duplicate_of is None and r.state != "WAITING"]
    if screened:
        parts += [
            "<h3>The structural screen</h3>",
            '<p class="what">Before the sampler, the job measured each single structural change the space allows '
            "(the whole-step graph, one candidate graphed, placed on a side stream or cut alone), then unions of "
            "the singles that gained within the NE budget: pairs, then all of them together.</p>",
            _table(["trial", "screen step", "phase", "qps_gain", "ne_gap"],
                   [[str(r.number), r.screen_name or r.plan_summary, r.phase,
                     _pct(r.qps_gain) if r.measured else r.state.lower(),
                     (_pct(r.ne_gap) + ("" if r.feasible else ", over the budget")) if r.measured else "-"]
                    for r in screened], numeric=(0, 3, 4)),
        ]
    return parts


def _figures_section(importance: Importance, pngs: dict[str, bytes]) -> list[str]:
    """The hypervolume, QPS spread and parameter importance figures."""
    e = html.escape
    parts: list[str] = []
    parts += [
        "<h2>Hypervolume</h2>",
        '<p class="what">The area of (QPS gain, NE gap) the plans found so far dominate, counted from the baseline\'s '
        "speed at the budget's NE gap, after each trial: it rises when a trial finds a better trade-off within the "
        "budget and stays flat otherwise.</p>",
        _img(pngs["hypervolume"], "hypervolume within the NE budget by trial"),
        "<h2>QPS spread per trial</h2>",
        '<p class="what">For each measured plan, its p90-QPS gain over the eager baseline (dot) and its median-QPS '
        "gain (tick) with the lowest-to-highest median gain over the timing windows that interleave it with the "
        "baseline (bar): a gain whose bar reaches zero is within measurement noise.</p>",
        _img(pngs["qps_spread"], "QPS gain per trial with its per-window spread"),
        "<h2>Parameter importance for qps_gain</h2>",
        '<p class="what">Which search-space parameters most decide whether a plan reaches the highest QPS gains.</p>',
    ]
    if "importance" in pngs:
        parts.append(_img(pngs["importance"], "parameter importance for qps_gain"))
    parts.append(f"<p>{e(importance.note)}</p>")
    return parts


def _failed_section(records: Sequence[TrialRecord]) -> list[str]:
    """The failed trials, each with its kind and reason."""
    parts: list[str] = []
    parts.append("<h2>Failed trials</h2>")
    failed = [r for r in records if r.state == "FAIL"]
    if failed:
        parts.append('<p class="what">A trial failure is the plan\'s own (it crashed, ran out of memory, produced '
                     "NaN or timed out); an infra failure is the cluster's (a worker or node lost).</p>")
        parts.append(_table(["trial", "kind", "reason", "plan"],
                            [[str(r.number), r.failure_kind or "-", r.failure_reason or "unknown", r.plan_summary]
                             for r in failed], numeric=(0,)))
    else:
        parts.append("<p>No trial failed.</p>")
    return parts


def write_report(study: optuna.Study, out_dir: str | Path) -> ReportFiles:
    """Write ``report.html`` (self-contained) and its PNGs for ``study`` into ``out_dir``."""
    out = _out_dir(out_dir)
    try:
        from erase_tune.tune.views import figures
    except ImportError as e:
        raise EraseTuneError(f"the report needs matplotlib ({e}): install erase-tune's tune extra") from None

    records = read_records(study)
    facts = study_facts(study, records)
    front = front_within_budget(records)
    points = [(r.qps_gain, r.ne_gap) if r.measured else None for r in records]
    history = hypervolume_history(points, facts.max_ne_gap)
    importance = param_importance(study, records)

    pngs = {
        "pareto_front": figures.pareto_figure(records, front, max_ne_gap=facts.max_ne_gap, gain_over=facts.gain_over,
                                              noise_band=facts.noise_band),
        "hypervolume": figures.hypervolume_figure([r.number for r in records], history, max_ne_gap=facts.max_ne_gap),
        "qps_spread": figures.spread_figure(records),
    }
    if importance.values:
        pngs["importance"] = figures.importance_figure(importance.values)
    paths = {key: out / _FILES[key] for key in _FILES}
    for key, png in pngs.items():
        _write_atomic(paths[key], png)
    if "importance" not in pngs:
        paths["importance"].unlink(missing_ok=True)  # a previous report's figure would contradict this page
    _write_atomic(paths["html"], _page(facts, records, front, history, importance, pngs).encode("utf-8"))
    return ReportFiles(html=paths["html"], pareto_front=paths["pareto_front"], hypervolume=paths["hypervolume"],
                       qps_spread=paths["qps_spread"], importance=paths["importance"] if "importance" in pngs else None)


def report(storage_url: str | None, study_name: str | None, out_dir: str | Path) -> ReportFiles:
    """Open the job's study read-only (a missing SQLite file is an error, never a new database)
    and write its report; without ``study_name``, the storage's only study. ``storage_url``
    None means the default storage, as for ``status``."""
    out = _check_out_dir(out_dir)  # before touching the database: a typo in -o fails at once
    db = open_storage(storage_url if storage_url is not None else default_storage_url(), must_exist=True,
                      upgrade=False)
    try:
        return write_report(load_study(db, study_name), out)
    finally:
        db.close()
