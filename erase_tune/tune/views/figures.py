"""The report's plots of a tuning job, drawn with matplotlib (Agg) into PNG bytes.

Each function takes records (``html_report.TrialRecord``: what one trial measured, read from
either study layout) and returns a PNG, so the figures can be tested and reused
without a study or a display. They draw on their own ``Figure`` (never pyplot's global
state), under matplotlib's default style whatever the user's matplotlibrc says, and write no
``Software`` or date metadata: the same study gives byte-identical PNGs on the same
matplotlib, so a regenerated report diffs cleanly.

Values are fractions (``0.093`` is a 9.3% gain); the axes print them as percentages.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import matplotlib

# The Agg canvas is attached to each Figure directly: no pyplot, so no global backend switch
# in a process (a notebook, say) that has chosen its own.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator, PercentFormatter

if TYPE_CHECKING:
    from erase_tune.tune.views.report_data import TrialRecord

__all__ = ["pareto_figure", "hypervolume_figure", "spread_figure", "importance_figure"]

_FEASIBLE = "#1f77b4"
_INFEASIBLE = "#9a9a9a"
_FRONT = "#d62728"
_DOMINATED_AREA = "#fbe3d6"
_BUDGET = "#444444"
_DPI = 110


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    # "Software" is matplotlib's only default PNG text chunk; dropping it keeps the bytes the
    # same across patch releases that render identically. PNGs carry no date by default.
    fig.savefig(buf, format="png", dpi=_DPI, metadata={"Software": None})
    return buf.getvalue()


def _draw(draw, width: float, height: float) -> bytes:
    """Run ``draw(fig)`` under matplotlib's default style (not the user's rc) and return the PNG."""
    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        matplotlib.rcParams.update({"font.size": 9, "axes.titlesize": 10, "legend.fontsize": 8,
                                    "axes.grid": True, "grid.alpha": 0.3})
        fig = _new_figure(width, height)
        draw(fig)
        return _png(fig)


def _pct(axis, decimals: int | None = None) -> None:  # fractions printed as percentages
    axis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=decimals))


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666666")


def _staircase(front: Sequence[TrialRecord], max_ne_gap: float) -> tuple[list[float], list[float]]:
    """Outline of the area the front dominates within the budget, from (0, lowest gap) round to
    (0, budget): the hypervolume drawn, so the figure and the number agree."""
    pts = sorted(((p.qps_gain, p.ne_gap) for p in front if p.qps_gain > 0 and p.ne_gap < max_ne_gap),
                 key=lambda p: p[1])
    if not pts:
        return [], []
    xs, ys = [0.0], [pts[0][1]]
    for i, (g, n) in enumerate(pts):
        xs += [g, g]
        ys += [n, pts[i + 1][1] if i + 1 < len(pts) else max_ne_gap]
    xs.append(0.0)
    ys.append(max_ne_gap)
    return xs, ys


def _labels(ax, items: Sequence[tuple[float, float, str]], *, color: str, offset: tuple[int, int],
            x_span: float, y_span: float) -> None:
    """Annotate points, merging the labels of points closer than ~3% of the axes into one
    (two seeds a hair apart would otherwise print on top of each other)."""
    groups: list[list[tuple[float, float, str]]] = []
    for item in items:
        for group in groups:
            x0, y0, _ = group[0]
            if abs(item[0] - x0) < 0.03 * x_span and abs(item[1] - y0) < 0.03 * y_span:
                group.append(item)
                break
        else:
            groups.append([item])
    for group in groups:
        x, y, _ = group[0]
        ax.annotate(", ".join(text for _, _, text in group), (x, y), textcoords="offset points", xytext=offset,
                    fontsize=7.5, color=color, zorder=6)


def pareto_figure(records: Sequence[TrialRecord], front: Sequence[TrialRecord], *, max_ne_gap: float,
                  gain_over: str, noise_band: float = 0.0) -> bytes:
    """QPS gain (x) against NE gap (y) of every measured trial: feasible ones filled, infeasible
    ones hollow grey, the front within the budget in red over the area it dominates, the budget
    as a dashed line, the baseline at (0, 0), the paper's configuration as a star, seeds named.
    The noise floor of the NE gap (``noise_band``, erase_tune.measure.noise) is a blue band ±band about 0
    and a dotted line at budget + band, where infeasibility begins.

    Two panels share the gain axis: all trials, then the band within the budget. Infeasible
    plans often lose several times the budget in NE, which would squash the band where the
    choice is made into a sliver of the first panel.
    """
    pareto = _Pareto(measured=[r for r in records if r.measured], front=list(front), max_ne_gap=max_ne_gap,
                     gain_over=gain_over, noise_band=noise_band)
    measured = pareto.measured

    def draw(fig: Figure) -> None:
        top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 3])
        gaps = [r.ne_gap for r in measured] + [0.0, max_ne_gap + noise_band, -noise_band]
        span = (max(gaps) - min(gaps)) or max(abs(max_ne_gap), 0.01)
        pareto.panel(top, min(gaps) - 0.06 * span, max(gaps) + 0.1 * span, legend=True)
        top.set_title("all measured plans", fontsize=9, loc="left")
        within = [r.ne_gap for r in measured if r.feasible] + [0.0, max_ne_gap, -noise_band]
        top_gap = max_ne_gap + noise_band
        band = (top_gap - min(within)) or max(abs(max_ne_gap), 0.01)
        pareto.panel(bottom, min(within) - 0.08 * band, top_gap + 0.12 * band, legend=False)
        bottom.set_title("within the NE budget (zoomed)", fontsize=9, loc="left")
        bottom.set_xlabel(f"qps_gain: p90 QPS gain over the {gain_over} baseline (maximize)")
        if not measured:
            _empty(top, "no measured trial yet")
        fig.suptitle("Pareto front: QPS gain against NE gap", fontsize=10)
        fig.legend(loc="outside right upper")  # beside the axes: a legend inside would hide points

    return _draw(draw, 11.0, 7.5)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Pareto:
    """What a panel of :func:`pareto_figure` shows: the measured trials, the front within the
    budget, the budget, the baseline and the noise floor."""

    measured: list[TrialRecord]
    front: list[TrialRecord]
    max_ne_gap: float
    gain_over: str
    noise_band: float

    def panel(self, ax: Any, y_lo: float, y_hi: float, legend: bool) -> None:
        """One panel: the NE gaps from ``y_lo`` to ``y_hi`` (``legend``: label its artists)."""
        self._areas(ax, y_hi, legend)
        self._points(ax, legend)
        gains = [r.qps_gain for r in self.measured] + [0.0]
        x_span, y_span = (max(gains) - min(gains)) or 0.1, y_hi - y_lo
        inside = [r for r in self.measured if y_lo <= r.ne_gap <= y_hi]
        _labels(ax, [(p.qps_gain, p.ne_gap, f"#{p.number}") for p in self.front if y_lo <= p.ne_gap <= y_hi],
                color=_FRONT, offset=(6, 4), x_span=x_span, y_span=y_span)
        _labels(ax, [(r.qps_gain, r.ne_gap, f"{r.seed_name} #{r.number}") for r in inside if r.seed_name],
                color="#555555", offset=(7, -11), x_span=x_span, y_span=y_span)
        ax.set_ylim(y_lo, y_hi)
        _pct(ax.xaxis)
        _pct(ax.yaxis)
        ax.set_ylabel("ne_gap (minimize)")

    def _areas(self, ax: Any, y_hi: float, legend: bool) -> None:
        """The area the front dominates, the region over the budget, the budget and the noise floor."""
        max_ne_gap, noise_band = self.max_ne_gap, self.noise_band
        xs, ys = _staircase(self.front, max_ne_gap)
        if xs:
            ax.fill(xs, ys, color=_DOMINATED_AREA, zorder=0,
                    label="area the front dominates (its hypervolume)" if legend else None)
        ax.axhspan(max_ne_gap, max(y_hi, max_ne_gap), color="#eeeeee", zorder=0)  # over the budget
        ax.axhline(max_ne_gap, color=_BUDGET, linestyle="--", linewidth=1,
                   label=f"NE budget: ne_gap \u2264 {max_ne_gap:.2%}" if legend else None)
        if noise_band > 0:
            ax.axhspan(-noise_band, noise_band, color="#cfe3f7", alpha=0.6, zorder=0,
                       label=f"noise floor of the NE gap: \u00b1{noise_band:.2%}" if legend else None)
            ax.axhline(max_ne_gap + noise_band, color=_BUDGET, linestyle=":", linewidth=1,
                       label=f"budget + noise: {max_ne_gap + noise_band:.2%}" if legend else None)

    def _points(self, ax: Any, legend: bool) -> None:
        """The trials (feasible filled, infeasible hollow, the front red), the baseline and the paper's plan."""
        front_numbers = {p.number for p in self.front}
        feas = [r for r in self.measured if r.feasible and r.number not in front_numbers]
        infeas = [r for r in self.measured if not r.feasible]
        paper = [r for r in self.measured if r.seed_name == "paper"]
        ax.scatter([r.qps_gain for r in feas], [r.ne_gap for r in feas], s=28, color=_FEASIBLE, zorder=3,
                   label="within the budget" if legend else None)
        ax.scatter([r.qps_gain for r in infeas], [r.ne_gap for r in infeas], s=28, facecolors="none",
                   edgecolors=_INFEASIBLE, linewidths=1.2, zorder=3, label="over the budget" if legend else None)
        ax.scatter([p.qps_gain for p in self.front], [p.ne_gap for p in self.front], s=60, color=_FRONT, zorder=4,
                   edgecolors="white", linewidths=0.8, label="Pareto front within the budget" if legend else None)
        ax.scatter([0.0], [0.0], marker="P", s=110, color="black", zorder=5,
                   label=f"baseline ({self.gain_over}): 0, 0" if legend else None)
        if paper:
            ax.scatter([r.qps_gain for r in paper], [r.ne_gap for r in paper], marker="*", s=240,
                       facecolors="#ffbf00", edgecolors="black", linewidths=0.7, zorder=6,
                       label="the paper's configuration" if legend else None)


def hypervolume_figure(numbers: Sequence[int], history: Sequence[float], *, max_ne_gap: float) -> bytes:
    """Hypervolume within the budget after each trial (by trial number), as a step line."""

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        # area in (gain %) x (NE-gap percentage points): 0.9 gain over 0.02 of gap is 180
        scaled = [h * 1e4 for h in history]
        if numbers:
            ax.step(numbers, scaled, where="post", color=_FRONT, linewidth=1.6)
            gains = [n for i, n in enumerate(numbers) if scaled[i] > (scaled[i - 1] if i else 0.0)]
            ax.scatter(gains, [scaled[numbers.index(n)] for n in gains], s=22, color=_FRONT, zorder=3,
                       label="a trial that grew it")
            ax.legend(loc="lower right")
        else:
            _empty(ax, "no trial yet")
        ax.set_ylim(bottom=0.0, top=max(scaled, default=0.0) * 1.08 or 1.0)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("trial number")
        ax.set_ylabel("hypervolume (QPS-gain % \u00d7 NE-gap %)")
        ax.set_title(f"Hypervolume within the NE budget ({max_ne_gap:.2%}), reference point: baseline speed "
                     "at the budget")

    return _draw(draw, 8.0, 4.2)


def spread_figure(records: Sequence[TrialRecord]) -> bytes:
    """Each measured trial's gain over eager, in trial order: the median-QPS gain (tick) with the
    lowest-to-highest gain over its interleaved timing windows (bar; the windows compare median
    QPS, so the bar belongs to the tick), and the p90 gain (dot). Grey: over the NE budget."""
    rows = [r for r in records if r.measured and r.gain_vs_eager is not None]
    width = min(18.0, max(8.0, 0.22 * len(rows) + 3))

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        ax.axhline(0.0, color="black", linewidth=0.8)
        for feasible, color in ((True, _FEASIBLE), (False, _INFEASIBLE)):
            group = [r for r in rows if bool(r.feasible) == feasible]
            bars = [r for r in group if r.gain_lo is not None and r.gain_hi is not None]
            ax.vlines([r.number for r in bars], [r.gain_lo for r in bars], [r.gain_hi for r in bars],
                      color=color, linewidth=2.4, alpha=0.4)
            med = [r for r in group if r.gain_median is not None]
            ax.scatter([r.number for r in med], [r.gain_median for r in med], marker="_", s=110, linewidths=1.6,
                       color=color, zorder=3)
            ax.scatter([r.number for r in group], [r.gain_vs_eager for r in group], s=24, color=color, zorder=4)
        if rows:
            # legend entries by meaning, not by colour group
            ax.plot([], [], color="#777777", linewidth=2.4, alpha=0.4, label="per-window range of the median gain")
            ax.scatter([], [], marker="_", s=110, linewidths=1.6, color="#777777", label="median-QPS gain")
            ax.scatter([], [], s=24, color="#777777", label="p90-QPS gain")
            ax.scatter([], [], s=24, color=_FEASIBLE, label="within the NE budget")
            ax.scatter([], [], s=24, color=_INFEASIBLE, label="over the NE budget")
            fig.legend(loc="outside lower center", ncols=3)
        else:
            _empty(ax, "no measured trial with a gain over eager")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _pct(ax.yaxis)
        ax.set_xlabel("trial number")
        ax.set_ylabel("QPS gain over the eager baseline")
        ax.set_title("QPS gain per trial and its spread over timing windows")

    return _draw(draw, width, 4.8)


def importance_figure(importances: Mapping[str, float], *, top: int = 20) -> bytes:
    """Horizontal bars of each parameter's share of importance for qps_gain, largest on top."""
    items = sorted(importances.items(), key=lambda kv: (-kv[1], kv[0]))[:top]

    def draw(fig: Figure) -> None:
        ax = fig.add_subplot()
        names = [k for k, _ in reversed(items)]
        values = [v for _, v in reversed(items)]
        ax.barh(names, values, color=_FEASIBLE)
        for y, v in enumerate(values):
            ax.text(v, y, f" {v:.0%}", va="center", fontsize=8)
        _pct(ax.xaxis, 0)
        ax.set_xlim(0, max(values, default=1.0) * 1.15 or 1.0)
        ax.grid(axis="y", visible=False)
        ax.set_xlabel("share of importance for qps_gain (PED-ANOVA)")
        ax.set_title("Which parameters decide the QPS gain")

    return _draw(draw, 8.0, max(2.6, 0.3 * len(items) + 1.2))
