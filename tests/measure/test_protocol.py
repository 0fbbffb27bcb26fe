"""The sequential interleaved protocol (erase_tune.measure.protocol), driven on the CPU by a seeded
fake window clock: synthetic step times from a known true speed per runner, with per-window and
per-step noise, so that when each plan stops, and what it reports, is known and repeatable."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from erase_tune.errors import EraseTuneError
from erase_tune.measure import GainEstimate, ProtocolHooks, Steps, StopRule, measure_gains, qps_summary, t_interval
from erase_tune.measure.protocol import estimate, window_gain


class FakeClock:
    """A window measure: runs the runner's steps (so step indices are real), then returns step
    times ``1 ms / speed``, scaled by one normal draw per window (sd ``window_sd``, the
    window-to-window swing of a host-bound step) and one per step (sd ``step_sd``). ``lucky``:
    ``{(runner, round): factor}`` multiplies that window's speed."""

    def __init__(self, speeds: dict[str, float], *, window_sd: float, step_sd: float = 0.02, seed: int = 0,
                 lucky: dict[tuple[str, int], float] | None = None) -> None:
        self.speeds, self.window_sd, self.step_sd = speeds, window_sd, step_sd
        self.rng = np.random.default_rng(seed)
        self.lucky = lucky or {}
        self.calls: dict[str, list[int]] = {name: [] for name in speeds}
        self.windows: dict[str, int] = {name: 0 for name in speeds}
        self.runners = {name: self._runner(name) for name in speeds}
        self._names = {id(r): n for n, r in self.runners.items()}

    def _runner(self, name: str):
        def step(i: int) -> None:
            self.calls[name].append(i)
        return step

    def __call__(self, step, first, count, device):
        name = self._names[id(step)]
        for k in range(count):
            step(first + k)
        speed = self.speeds[name] * self.lucky.get((name, self.windows[name]), 1.0)
        self.windows[name] += 1
        window = max(0.5, 1.0 + self.rng.normal(0.0, self.window_sd))
        steps = np.clip(1.0 + self.rng.normal(0.0, self.step_sd, count), 0.5, None)
        return list(1e-3 / speed * window * steps)


def run(clock: FakeClock, pairs, rule: StopRule, **kw):
    hooks = ProtocolHooks(window=clock, agree=kw.pop("agree", None))
    return measure_gains(clock.runners, device="cpu", steps=Steps(warmup_steps=2, window_steps=10), rule=rule,
                         pairs=pairs, hooks=hooks, **kw)


def test_a_plan_stops_once_its_interval_is_narrow():
    clock = FakeClock({"base": 1.0, "plan": 1.10}, window_sd=0.005)
    res = run(clock, {"plan": "base"}, StopRule(min_windows=4, max_windows=20, halfwidth=0.03))
    g = res.gains["plan"]
    assert g.stopped == "narrow" and g.windows == 4 and res.rounds == 4
    assert g.halfwidth <= 0.03 and g.lo < 0.10 < g.hi
    assert g.lo <= g.median <= g.hi and len(g.per_window) == 4
    assert res.timings.clock == "custom" and set(res.timings.variants["plan"].window) == {0, 1, 2, 3}


def test_a_plan_behind_the_race_bound_stops_before_the_cap():
    # ±3% per window: the interval stays wider than ±3% for a while, but its upper end is far below +10%.
    clock = FakeClock({"base": 1.0, "plan": 0.95}, window_sd=0.03, seed=1)
    res = run(clock, {"plan": "base"}, StopRule(min_windows=4, max_windows=20, halfwidth=0.01, below=0.10))
    g = res.gains["plan"]
    assert g.stopped == "behind" and g.windows < 20 and g.hi < 0.10
    # The same plan without a race runs on until its interval is narrow or capped.
    again = run(FakeClock({"base": 1.0, "plan": 0.95}, window_sd=0.03, seed=1), {"plan": "base"},
                StopRule(min_windows=4, max_windows=20, halfwidth=0.01))
    assert again.gains["plan"].windows > g.windows and again.gains["plan"].stopped in ("narrow", "cap")


def test_large_noise_runs_to_the_cap():
    clock = FakeClock({"base": 1.0, "plan": 1.05}, window_sd=0.2, seed=2)
    res = run(clock, {"plan": "base"}, StopRule(min_windows=4, max_windows=12, halfwidth=0.03))
    g = res.gains["plan"]
    assert g.stopped == "cap" and g.windows == 12 and g.halfwidth > 0.03
    assert clock.windows == {"base": 12, "plan": 12}


def test_one_lucky_window_does_not_outrank_a_steadier_better_plan():
    """``steady`` is 5% faster in every window; ``lucky`` is no faster, but one of its windows ran
    35% fast. Pooled per-step p90 QPS (the old ranking) puts ``lucky`` first; the robust
    estimate (mean of per-window median ratios) does not."""
    clock = FakeClock({"base": 1.0, "steady": 1.05, "lucky": 1.0}, window_sd=0.01, seed=3,
                      lucky={("lucky", 2): 1.35})
    res = run(clock, {"steady": "base", "lucky": "base"}, StopRule(min_windows=8, max_windows=8))
    steady, lucky = res.gains["steady"], res.gains["lucky"]
    assert steady.gain > lucky.gain and steady.median > lucky.median
    assert max(lucky.per_window) > 0.3  # the lucky window is in there ...
    p90 = {n: qps_summary(t.steps_s, 1).p90 for n, t in res.timings.variants.items()}
    assert p90["lucky"] > p90["steady"]  # ... and would have won on the pooled fast end


def test_a_zero_gain_is_not_reported_as_a_gain():
    """Seed 4 (checked): three plans exactly as fast as the baseline, ±5% per window; every
    interval holds 0. Over 200 seeds (100..299) the 95% intervals hold 0 in 180 runs: 90%, a few
    points under nominal, as expected of stopping on the interval's width (a plan stops early when
    its sample spread happens to be small; 20 fixed windows hold it in 93% of such runs), and the
    per-window gain of two equal runners is centred on 0 only up to sd² (0.25% here)."""
    speeds = {"base": 1.0, "a": 1.0, "b": 1.0, "c": 1.0}
    rule = StopRule(min_windows=4, max_windows=20, halfwidth=0.03)
    res = run(FakeClock(speeds, window_sd=0.05, seed=4), {"a": "base", "b": "base", "c": "base"}, rule)
    for name in "abc":
        g = res.gains[name]
        assert g.lo <= 0.0 <= g.hi, (name, g)
    held = 0
    for seed in range(200):
        res = run(FakeClock({"base": 1.0, "a": 1.0}, window_sd=0.05, seed=100 + seed), {"a": "base"}, rule)
        held += res.gains["a"].lo <= 0.0 <= res.gains["a"].hi
    assert held >= 176


def test_every_runner_sees_the_same_batch_sequence_even_when_plans_stop_at_different_rounds():
    # "fast" is narrow at once, "noisy" runs to the cap: "base" runs as long as "noisy" does.
    clock = FakeClock({"base": 1.0, "fast": 1.2, "noisy": 1.0}, window_sd=0.0, step_sd=0.0, seed=5)
    clock_noise = {"noisy": 0.3}
    original = clock.__call__

    def window(step, first, count, device):
        name = clock._names[id(step)]
        out = original(step, first, count, device)
        scale = 1.0 + (clock.rng.normal(0.0, clock_noise[name]) if name in clock_noise else 0.0)
        return [t * max(scale, 0.3) for t in out]

    res = measure_gains(clock.runners, device="cpu", steps=Steps(warmup_steps=3, window_steps=5, start_step=7),
                        rule=StopRule(min_windows=3, max_windows=9), pairs={"fast": "base", "noisy": "base"},
                        hooks=ProtocolHooks(window=window))
    assert res.gains["fast"].windows == 3 and res.gains["noisy"].windows == 9 and res.rounds == 9
    longest = clock.calls["base"]
    assert longest == list(range(7, 7 + 3 + 9 * 5))
    for name, calls in clock.calls.items():
        assert calls == longest[:len(calls)], name  # a prefix of one sequence: the same batches
        assert res.next_steps[name] == 7 + len(calls)
    assert len(clock.calls["fast"]) == 3 + 3 * 5
    assert res.timings.steps_run == 3 + 9 * 5 and res.timings.next_step == 7 + 3 + 9 * 5
    # In every round the runners that ran used the same step indices.
    for name in ("fast", "noisy"):
        labels = res.timings.variants[name].window
        assert list(labels) == [w for w in range(res.gains[name].windows) for _ in range(5)]


def test_a_reference_runs_while_a_plan_needs_it_and_further_references_are_measured_too():
    clock = FakeClock({"base": 1.0, "graph": 1.3, "cand": 1.2, "twin": 1.1}, window_sd=0.01, seed=6)
    res = run(clock, {"cand": ("base", "graph"), "twin": "base"}, StopRule(min_windows=5, max_windows=10),
              deciding=["cand"])
    cand, twin = res.gains["cand"], res.gains["twin"]
    assert cand.stopped == "narrow" and twin.windows == cand.windows == 5 and twin.stopped == "narrow"
    assert res.vs("cand", "base") is cand and res.vs("cand", "graph").windows == 5
    assert res.vs("cand", "graph").gain == pytest.approx(1.2 / 1.3 - 1, abs=0.02)
    assert cand.gain == pytest.approx(0.2, abs=0.02) and twin.gain == pytest.approx(0.1, abs=0.02)
    assert set(clock.windows.values()) == {5}


def test_agree_decides_for_every_rank():
    """A data-parallel measurement acts on rank 0's gains: what ``agree`` returns is what is kept
    and what the stop rule reads."""
    clock = FakeClock({"base": 1.0, "plan": 1.0}, window_sd=0.3, seed=7)
    seen = []

    def agree(gains):
        seen.append(list(gains))
        return [0.07]

    res = run(clock, {"plan": "base"}, StopRule(min_windows=3, max_windows=20), agree=agree)
    g = res.gains["plan"]
    assert g.per_window == (0.07, 0.07, 0.07) and g.stopped == "narrow" and g.gain == pytest.approx(0.07)
    assert len(seen) == 3 and all(len(s) == 1 for s in seen)


def test_fixed_windows_when_min_equals_max():
    clock = FakeClock({"base": 1.0, "plan": 1.0}, window_sd=0.0, step_sd=0.0, seed=8)
    res = run(clock, {"plan": "base"}, StopRule(min_windows=5, max_windows=5, halfwidth=0.5))
    assert res.gains["plan"].windows == 5 and res.gains["plan"].stopped == "narrow"
    one = run(FakeClock({"base": 1.0, "plan": 1.0}, window_sd=0.1), {"plan": "base"},
              StopRule(min_windows=1, max_windows=1))
    assert one.gains["plan"].windows == 1 and one.gains["plan"].stopped == "cap"  # one window: no interval to stop on


def test_window_gain_is_the_ratio_of_window_medians():
    # One very slow step does not move a window's median.
    assert window_gain([1.0, 1.0, 9.0], [2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert window_gain([0.5, 0.5], [1.0, 1.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="finite number of seconds"):
        window_gain([0.0], [1.0])


def test_estimate_and_t_interval():
    mean, lo, hi = t_interval([0.1, 0.2, 0.3])
    assert mean == pytest.approx(0.2) and hi - mean == pytest.approx(4.303 * 0.1 / 3 ** 0.5, rel=1e-4)
    assert t_interval([0.5]) == (0.5, 0.5, 0.5)
    e = estimate([0.1, 0.2, 0.3, 1.0], "cap")
    assert e.median == pytest.approx(0.25) and e.windows == 4 and e.lo < e.gain < e.hi
    assert e.to_dict()["per_window"] == [0.1, 0.2, 0.3, 1.0]
    with pytest.raises(ValueError, match="stopped"):
        dataclasses.replace(e, stopped="bored")
    with pytest.raises(ValueError, match="windows"):
        GainEstimate(gain=0.0, median=0.0, lo=0.0, hi=0.0, per_window=(0.0,), windows=2, stopped="cap")


@pytest.mark.parametrize("kw, message", [
    ({"min_windows": 0}, "stop_rule.min_windows: 0 must be an integer in 1..1000000"),
    ({"min_windows": True}, "stop_rule.min_windows: True must be"),
    ({"min_windows": 5, "max_windows": 4}, "stop_rule.max_windows: 4 must be >= min_windows (5)"),
    ({"halfwidth": 0.0}, "stop_rule.halfwidth: 0.0 must be a number in (0, 1)"),
    ({"halfwidth": float("nan")}, "stop_rule.halfwidth: nan must be"),
    ({"halfwidth": 1}, "stop_rule.halfwidth: 1 must be"),
    ({"below": float("inf")}, "stop_rule.below: inf must be a finite number or None"),
    ({"below": False}, "stop_rule.below: False must be"),
])
def test_stop_rule_refusals_are_one_line(kw, message):
    with pytest.raises(EraseTuneError) as e:
        StopRule(**kw)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_pairs_are_checked():
    clock = FakeClock({"base": 1.0, "plan": 1.0, "stray": 1.0}, window_sd=0.0)
    rule = StopRule()
    with pytest.raises(ValueError, match="neither a plan nor a reference"):
        run(clock, {"plan": "base"}, rule)
    with pytest.raises(ValueError, match="not in runners"):
        run(clock, {"plan": "nobody", "stray": "base"}, rule)
    with pytest.raises(ValueError, match="each once"):
        run(clock, {"plan": ("base", "plan"), "stray": "base"}, rule)
    with pytest.raises(ValueError, match="deciding"):
        run(clock, {"plan": "base", "stray": "base"}, rule, deciding=["base"])
