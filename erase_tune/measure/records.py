"""What a trial is given and what it gives back, as plain records: the budget it spends, the
timings and gains it measured, and the bounds on both. Nothing here needs torch: the service's
read-only commands (``status``, ``report``, ``db``) read these records
without loading it; :mod:`erase_tune.measure.trial` runs trials and returns them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from erase_tune.errors import EraseTuneError, shown
from erase_tune.runtime.plan import ErasePlan
from erase_tune.workloads.limits import MAX_SEED

if TYPE_CHECKING:
    from erase_tune.measure.protocol import StopRule
    from erase_tune.measure.timing import Steps

__all__ = ["Budget", "VariantResult", "TrialResult", "GRAPH_WARMUP", "MAX_STEPS", "MAX_REPEATS", "GAIN_OVER",
           "MAX_CONFIRM_WINDOWS"]

GRAPH_WARMUP = 3
"""Eager steps an engine runs before capturing a CUDA graph (capture happens on the next)."""
MAX_STEPS = 1_000_000
"""Largest step count of any budget field: a trial is minutes, not weeks."""
MAX_REPEATS = 100
"""Largest noise_repeats, quality_scale and quality_seeds."""
_REPEATS = ("noise_repeats", "quality_scale", "quality_seeds")
GAIN_OVER = ("eager", "graph")
"""``eager``: over the plain engine with no cuts. ``graph``: over the whole step captured as
one CUDA graph with no cuts (CUDA only)."""
MAX_CONFIRM_WINDOWS = 1000
"""The most windows a confirmation may be asked to take at least (``--repeats``): a thousand
windows of 30 steps are already hours of a host-bound step per plan; more is a typo."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Budget:
    """How long a trial trains and times each variant."""

    warmup_steps: int = 8
    """Untimed steps per variant first (covers graph warm-up and capture)."""
    windows: int = 4
    """Alternating timing rounds at least (each variant runs one window per round); the trial then
    times on until its gain's interval is narrow (``halfwidth``), it loses its race, or ``max_windows``."""
    max_windows: int = 20
    """Timing rounds at most (>= windows; equal: a fixed number of windows, as before)."""
    halfwidth: float = 0.03
    """A trial stops timing once its gain's 95% interval is at most ± this (0 < h < 1; 0.03 = ±3%)."""
    window_steps: int = 10
    """Timed steps per window."""
    quality_steps: int = 0
    """Extra untimed training steps for baseline and candidate before NE is measured."""
    seed: int = 0
    """Seed for weights and data order."""
    reference: bool = True
    """Also time the whole-step-graph baseline (the honest competitor; CUDA only)."""
    detach_only: bool = True
    """Also time the candidate's detach-only twin (splits work removed from overlap gained)."""
    # The three fields below are read by the service around the trials, never by a trial.
    noise_repeats: int = 3
    """Data orders the noise floor of the NE gap is measured over (erase_tune.measure.noise; 0: none)."""
    quality_scale: int = 1
    """Quality confirmation trains finalists this many times a trial's training steps (0: none;
    at 1 it reuses the noise floor's baseline trainings: erase_tune.measure.noise)."""
    quality_seeds: int = 3
    """Seeds (data orders) of the quality confirmation; its NE gap interval is over these."""

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "windows", "max_windows", "window_steps", "quality_steps", "seed",
                     "noise_repeats", "quality_scale", "quality_seeds"):
            value = getattr(self, name)
            top = MAX_SEED if name == "seed" else MAX_REPEATS if name in _REPEATS else MAX_STEPS
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                text = "a huge integer" if isinstance(value, int) and abs(value) > 10**12 else repr(value)
                raise EraseTuneError(f"budget.{name}: {text} must be an integer in 0..{top}")
        if self.warmup_steps < GRAPH_WARMUP + 2:
            raise EraseTuneError(
                f"budget.warmup_steps: {self.warmup_steps} is too short; every trial warms each variant up for at "
                f"least {GRAPH_WARMUP + 2} untimed steps, on a CPU too (no graph is captured there, but one budget "
                "must mean the same on every device, and a CUDA graph needs them: eager warm-up, capture, one replay)"
            )
        if self.windows < 1 or self.window_steps < 1:
            raise EraseTuneError("budget.windows and budget.window_steps must be >= 1")
        if self.max_windows < self.windows:
            raise EraseTuneError(f"budget.max_windows: {self.max_windows} must be >= budget.windows ({self.windows})")
        h = self.halfwidth
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not math.isfinite(h) or not 0 < h < 1:
            raise EraseTuneError(f"budget.halfwidth: {shown(h)} must be a number in (0, 1), e.g. 0.03 for ±3%")
        if self.quality_scale and not self.quality_seeds:
            raise EraseTuneError("budget.quality_seeds: must be >= 1 when budget.quality_scale is set (0 turns "
                                 "quality confirmation off)")

    @property
    def training_steps(self) -> int:
        """Steps a trial trains at most: warm-up + ``max_windows`` × ``window_steps`` + ``quality_steps``.
        Baseline and candidate have trained exactly this many when NE is measured (the quality
        phase trains on from wherever the timing stopped), so every trial's NE, a cached baseline
        NE and the noise floor are after the same training; a plan verified exact is not trained
        for NE and stops where its timing did (at least :attr:`min_training_steps`)."""
        return self.warmup_steps + self.max_windows * self.window_steps + self.quality_steps

    @property
    def min_training_steps(self) -> int:
        """Steps every timed variant trains at least: warm-up + ``windows`` × ``window_steps``."""
        return self.warmup_steps + self.windows * self.window_steps

    def steps(self) -> Steps:
        """The protocol's warm-up and window steps for this budget."""
        from erase_tune.measure.timing import Steps

        return Steps(warmup_steps=self.warmup_steps, window_steps=self.window_steps)

    def stop_rule(self, below: float | None = None) -> StopRule:
        """The protocol's stop rule for this budget (``below``: the racing bound, if any)."""
        from erase_tune.measure.protocol import StopRule

        return StopRule(min_windows=self.windows, max_windows=self.max_windows, halfwidth=self.halfwidth,
                        below=below)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VariantResult:
    """Timing of one variant: summary and raw per-step samples."""

    name: str
    plan: str
    p90_qps: float
    median_qps: float
    steps_s: tuple[float, ...]
    window: tuple[int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialResult:
    """Everything one trial measured, with provenance."""

    workload: str
    plan: ErasePlan
    batch_size: int
    variants: Mapping[str, VariantResult]
    """``baseline``, ``candidate`` and, where run, ``detach_only`` and ``reference``."""
    ne_baseline: float | None
    """The baseline's held-out NE; for a plan verified exact, the cached one if given, else None."""
    ne_candidate: float | None
    """The candidate's held-out NE; for a plan verified exact (not trained for NE), ``ne_baseline``."""
    ne_gap: float
    """``(NE_cand - NE_base) / NE_base``; 0 for a plan verified exact."""
    gain: float
    """Candidate over the ``gain_over`` baseline: mean of the per-window median-QPS gains (what a
    study ranks by)."""
    gain_lo: float
    """Lower end of the 95% interval of ``gain``."""
    gain_hi: float
    """Upper end of the 95% interval of ``gain``."""
    windows: int
    """Timing windows (rounds) the candidate ran."""
    stopped: str
    """Why timing stopped: ``narrow`` (interval within ±budget.halfwidth), ``behind`` (below the race
    bound) or ``cap``."""
    gain_p90: float
    """Candidate over baseline, p90 of per-step QPS (the paper's headline statistic)."""
    gain_median: float
    """Candidate over baseline, median of pooled per-step QPS."""
    gain_spread: tuple[float, float]
    """Lowest and highest per-window median-QPS gain over baseline."""
    gain_vs_reference: float | None
    """Candidate over the whole-step-graph baseline (p90), where that ran."""
    gain_vs_reference_interval: tuple[float, float, float] | None
    """Candidate over the whole-step-graph baseline: (gain, lo, hi) as for ``gain``, where that ran."""
    gain_detach_only: float | None
    """Detach-only twin over baseline (p90): the part of the gain that is work removed."""
    exact: bool
    """The plan changes no gradient, checked: its gradients after the last warm-up step equal the baseline's."""
    exact_diff: float | None
    """Largest relative gradient difference the exactness check found (None: not checked, the plan has cuts)."""
    duration_s: float
    provenance: Mapping[str, Any]
    reference_error: str | None = None
    """Why the whole-step-graph reference was left out (its capture failed), in one line; None
    when it ran or was not asked for."""
    ne_tasks: Mapping[str, Mapping[str, float | None]] | None = None
    """A multi-task workload's NE per task: ``{task: {"baseline", "candidate", "gap"}}`` (each task
    against its own label prior; ``ne_*`` above are the main task's). None for a single task. A
    value not measured (the baseline's, when a cached ``baseline_ne`` stood in for it) is None."""
    data_note: str | None = None
    """Set when training read its batches more than once (provenance ``data_passes`` above 1):
    what that means for NE and the remedy, one phrase in the workload's arguments' words."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, raw samples included."""
        out = dataclasses.asdict(self)
        out["plan"] = self.plan.to_dict()
        out["variants"] = {k: dataclasses.asdict(v) for k, v in self.variants.items()}
        out["provenance"] = dict(self.provenance)
        return out
