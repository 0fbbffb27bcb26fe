"""Text the CLI prints: a trial's table, a job's progress line and its closing summary.

Kept apart from the commands so that the CLI stays a table of thin calls and the wording
lives in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: `trial` and `bench` print tables without loading the job's stack
    from erase_tune.measure.quality import NoiseFloor
    from erase_tune.measure.records import TrialResult
    from erase_tune.tune.run.job import JobSummary
    from erase_tune.tune.run.loop import Progress

__all__ = ["trial_table", "noise_line", "progress_line", "start_summary", "duration"]


def duration(seconds: float) -> str:
    """``1h02m``, ``3m05s`` or ``42s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def task_line(result: TrialResult) -> str:
    """A multi-task trial's NE per task: ``NE per task (main click): click 0.8123 -> 0.8150 (+0.33%), ...``."""
    def value(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    parts = [f"{name} {value(ne['baseline'])} -> {value(ne['candidate'])} "
             f"({'-' if ne['gap'] is None else format(ne['gap'], '+.2%')})" for name, ne in (result.ne_tasks or {}).items()]
    main = result.provenance.get("main_task")
    return f"NE per task{f' (main {main})' if main else ''}: " + ", ".join(parts)


def trial_table(result: TrialResult, floor: NoiseFloor | None = None) -> str:
    """A trial's table; with ``floor`` (``trial --noise-floor``), the NE gap's noise floor after it."""
    prov = result.provenance
    lines = [f"workload {result.workload} (batch {result.batch_size}) on {prov['device_name']}, torch {prov['torch']}",
             f"plan: {result.plan.describe()}",
             f"{'variant':<12} {'p90 QPS':>12} {'median QPS':>12} {'gain p90':>9} {'NE':>7}"]
    base = result.variants["baseline"].p90_qps
    ne = {"baseline": result.ne_baseline, "candidate": result.ne_candidate}
    for name, v in result.variants.items():
        ne_s = f"{ne[name]:.4f}" if ne.get(name) is not None else "-"
        lines.append(f"{name:<12} {v.p90_qps:>12,.0f} {v.median_qps:>12,.0f} {v.p90_qps / base - 1:>+9.1%} {ne_s:>7}")
    lo, hi = result.gain_spread
    over = "whole-step-graph baseline" if result.provenance.get("gain_over") == "graph" else "baseline"
    lines.append(f"gain {result.gain:+.2%} [95% interval {result.gain_lo:+.2%}, {result.gain_hi:+.2%}] "
                 f"over the {over}, {result.windows} windows (stopped: {result.stopped})")
    ne_gap = (f"NE gap 0 (exact: gradients equal the baseline's, largest difference {result.exact_diff:.1e}; "
              "not trained for NE)" if result.exact else f"NE gap {result.ne_gap:+.2%}")
    lines.append(f"gain p90 {result.gain_p90:+.2%} (median {result.gain_median:+.2%}, per window {lo:+.1%}..{hi:+.1%});"
                 f" {ne_gap}")
    if result.ne_tasks:
        lines.append(task_line(result))
    if result.gain_detach_only is not None:
        lines.append(f"of which work removed (detach only): {result.gain_detach_only:+.2%}")
    if result.gain_vs_reference is not None:
        lines.append(f"vs whole-step-graph baseline: {result.gain_vs_reference:+.2%}")
    if result.reference_error is not None:
        lines.append(f"whole-step-graph baseline left out: {result.reference_error}")
    if result.data_note is not None:
        lines.append(f"note: {result.data_note}")
    if floor is not None:
        lines.append(noise_line(floor, result.ne_gap, exact=result.exact))
    return "\n".join(lines)


def noise_line(floor: NoiseFloor, ne_gap: float | None = None, *, exact: bool = False) -> str:
    """The noise floor of the NE gap, and where a trial's ``ne_gap`` lies against it (``exact``:
    the trial checked that its plan changes no gradient, so the gap is not a judgement)."""
    line = f"noise floor of the NE gap: {floor.describe()}"
    if exact:
        return line + (f"\nthis plan has no cuts: exact by construction (gradients checked), its NE gap "
                       f"{ne_gap:+.3%} is noise")
    if ne_gap is not None:
        within = abs(ne_gap) <= floor.band
        line += f"\nthis plan's NE gap {ne_gap:+.3%} is {'within' if within else 'beyond'} the noise"
    return line


def progress_line(p: Progress) -> str:
    best = (f"best within NE budget {p.best.qps_gain:+.2%} at NE gap {p.best.ne_gap:+.2%} (trial {p.best.number})"
            if p.best else "no trial within the NE budget yet")
    eta = f", about {duration(p.eta_s)} left" if p.eta_s is not None and p.done < p.target else ""
    return (f"{p.message}\n  [{p.done}/{p.target} measured, {p.running} running, {p.failed} failed; "
            f"{duration(p.elapsed_s)} elapsed{eta}] {best}")


def start_summary(s: JobSummary) -> str:
    o = s.overhead
    lines = [f"study {s.study_name}: {s.complete} complete, {s.failed} failed" + (f" ({s.stopped})" if s.stopped else "")]
    if o.get("trials"):
        lines.append(f"overhead per trial: ask {o['ask']:.3f}s + record {o['record']:.3f}s + Ray dispatch "
                     f"{o['dispatch']:.3f}s = {o['per_trial']:.2%} of {o['trial']:.1f}s trial time; once per job: "
                     f"worker start {o['worker_start'] * o['trials']:.1f}s ({o['fraction']:.2%} with it amortised "
                     f"over {o['trials']:.0f} trials)")
    if s.front:
        lines.append("Pareto front within the NE budget (best first): "
                     + ", ".join(f"trial {p.number} {p.qps_gain:+.2%}/{p.ne_gap:+.2%}" for p in s.front))
    for number, (gain, lo, hi) in s.confirmed.items():
        verdict = "confirmed gain" if lo > 0 else "no confirmed gain"
        lines.append(f"  trial {number} re-measured: {gain:+.2%} [95% interval {lo:+.2%}, {hi:+.2%}]: {verdict}")
    if s.noise_band:
        lines.append(f"noise floor of the NE gap: ±{s.noise_band:.2%} (gaps within the budget plus it are feasible)")
    for number, (gap, lo, hi) in s.quality.items():
        lines.append(f"  trial {number} trained on other data orders: NE gap {gap:+.2%} [95% interval {lo:+.2%}, {hi:+.2%}]")
    if s.chosen is not None:
        gain, lo, hi = s.confirmed[s.chosen]
        exact = " (exact: gradients checked equal to the baseline's, NE gap 0)" if any(
            p.number == s.chosen and p.user_attrs.get("exact") for p in s.front) else ""
        lines.append(f"export will write trial {s.chosen}: {gain:+.2%} [{lo:+.2%}, {hi:+.2%}], the best confirmed lower "
                     f"bound{exact}")
    elif s.refusal is not None:
        lines.append(f"export will write nothing: {s.refusal}")
    return "\n".join(lines)
