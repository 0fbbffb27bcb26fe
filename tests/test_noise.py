"""The noise floor of the NE gap and the quality confirmation (erase_tune.measure.noise), on the CPU, on a
bf16 transformer with rotary attention and value embeddings."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from erase_tune import Cut, ErasePlan
from erase_tune.errors import EraseTuneError
from erase_tune.measure.noise import (
    NoiseFloor,
    QualitySettings,
    TrainStart,
    confirm_quality,
    data_order,
    exact_by_construction,
    feasible,
    measure_noise_floor,
    quality_trainings,
    train_ne,
)
from erase_tune.runtime import Graphed, Placement
from erase_tune.measure.trial import Budget, run_trial
from tests.runtime.transformer import transformer_workload

BUDGET = Budget(warmup_steps=5, windows=1, max_windows=1, window_steps=2, quality_steps=8)  # 15 training steps
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def workload():
    return transformer_workload(batch=4, seq=16, train_batches=6, eval_batches=2)


def test_the_noise_floor_is_measured_finite_and_from_real_perturbations(workload):
    floor = measure_noise_floor(workload, BUDGET, repeats=2, device="cpu")
    assert floor.kinds == ("order", "order") and len(floor.gaps) == 2  # no whole-step graph on the CPU
    assert all(math.isfinite(g) for g in floor.gaps) and math.isfinite(floor.ne_reference)
    assert floor.band == max(abs(g) for g in floor.gaps)
    # Another order of the same batches really trains differently in bf16: the band is not 0 ...
    assert floor.band > 0
    # ... and the reference is the trial's own baseline training (same steps, same order).
    data = workload.make_data(CPU)
    torch.manual_seed(BUDGET.seed)
    again = train_ne(TrainStart(workload=workload, init=workload.build_model(), data=data, device=CPU),
                     ErasePlan(), BUDGET.training_steps, random_seed=BUDGET.seed)
    assert again == floor.ne_reference
    assert floor.training_steps == BUDGET.training_steps and floor.provenance["repeats"] == 2
    assert NoiseFloor.from_dict(floor.to_dict()) == floor


def test_a_permuted_order_uses_the_same_batches(workload):
    """The perturbation cannot matter: the same multiset of batches, the same number of steps."""
    from erase_tune.measure.noise import _order

    plain, permuted = _order(40, 6, None), _order(40, 6, 7)
    assert plain == [s % 6 for s in range(40)] and sorted(plain) == sorted(permuted) and plain != permuted


def test_refusals_are_one_line(workload):
    with pytest.raises(EraseTuneError, match="needs CUDA"):
        measure_noise_floor(workload, BUDGET, repeats=1, device="cpu", graph=True)
    with pytest.raises(EraseTuneError, match="noise repeats: 0 must be"):
        measure_noise_floor(workload, BUDGET, repeats=0, device="cpu")
    with pytest.raises(EraseTuneError, match="quality seeds"):
        confirm_quality(workload, {}, budget=BUDGET, settings=QualitySettings(seeds=0), device="cpu")


def test_a_plan_with_no_cuts_is_never_infeasible_for_its_ne_gap(workload):
    """Placements and graphed pieces only: the trial's NE gap is whatever noise gives, and the
    rule never calls it over budget, even at a budget of 0 and no measured band."""
    plan = ErasePlan(placements=(Placement(module="blocks.0", stream=1),),
                     graphs=(Graphed(module="blocks.2.mlp"),), num_streams=1)
    assert exact_by_construction(plan) and not exact_by_construction(ErasePlan(cuts=(Cut(module="blocks.0"),)))
    result = run_trial(workload, plan, BUDGET, device="cpu")
    assert math.isfinite(result.ne_gap)
    assert feasible(result.ne_gap, 0.0, 0.0, exact=True)
    # A cut plan is judged on its gap, against the budget plus the band:
    assert not feasible(0.03, 0.02, 0.005) and feasible(0.024, 0.02, 0.005)


def test_quality_confirmation_trains_longer_over_seeds(workload):
    plans = {"cut": ErasePlan(cuts=(Cut(module="blocks.1.mlp", aux_weight=1.0),)), "exact": ErasePlan(
        placements=(Placement(module="blocks.0", stream=1),), num_streams=1)}
    res = confirm_quality(workload, plans, budget=BUDGET, settings=QualitySettings(scale=2, seeds=2, band=0.01),
                          device="cpu")
    assert res.steps == 2 * BUDGET.training_steps and len(res.ne_baseline) == 2
    assert res.ne_baseline[0] != res.ne_baseline[1]  # another seed is another data order
    cut = res.plans["cut"]
    assert len(cut.per_seed) == 2 and cut.lo <= cut.ne_gap <= cut.hi and cut.lo < cut.hi and not cut.exact
    assert cut.ne_gap == pytest.approx(sum(cut.per_seed) / 2)
    exact = res.plans["exact"]
    assert exact.exact and exact.ne_gap == 0 and (exact.lo, exact.hi) == (-0.01, 0.01) and exact.per_seed == ()
    assert not exact.above_budget(0.0) and cut.above_budget(cut.ne_gap - 1.0) and not cut.above_budget(cut.ne_gap)


def test_quality_at_the_trials_length_reuses_the_noise_floors_baseline_and_never_the_trials_order(workload):
    """At scale 1 the confirmation's orders are the noise floor's, so the baseline's trainings
    on them are the floor's: the baseline NEs it reports are the floor's, bit for bit, and the
    same confirmation without the floor trains the baseline to the same values (CPU: deterministic).
    None of its orders is the trial's own, on which the plan was chosen."""
    plans = {"cut": ErasePlan(cuts=(Cut(module="blocks.1.mlp", aux_weight=1.0),))}
    floor = measure_noise_floor(workload, BUDGET, repeats=2, device="cpu")
    assert sorted(floor.baseline_ne) == [data_order(BUDGET, 1), data_order(BUDGET, 2)]
    assert NoiseFloor.from_dict(floor.to_dict()) == floor  # the orders survive JSON (string keys)
    settings = QualitySettings(scale=1, seeds=3)
    reused = confirm_quality(workload, plans, budget=BUDGET, device="cpu",
                             settings=dataclasses.replace(settings, floor=floor))
    fresh = confirm_quality(workload, plans, budget=BUDGET, settings=settings, device="cpu")
    assert reused.seeds == fresh.seeds == tuple(data_order(BUDGET, k) for k in (1, 2, 3))
    assert reused.ne_baseline[:2] == tuple(floor.baseline_ne[o] for o in reused.seeds[:2])
    assert reused.ne_baseline == fresh.ne_baseline and reused.plans == fresh.plans
    assert reused.provenance["baseline_from_noise_floor"] == list(reused.seeds[:2])
    assert fresh.provenance["baseline_from_noise_floor"] == []
    # The reused values are really what the gaps are taken against (a floor that says otherwise moves them) ...
    told = dataclasses.replace(floor, baseline_ne={o: 2 * ne for o, ne in floor.baseline_ne.items()})
    moved = confirm_quality(workload, plans, budget=BUDGET, device="cpu",
                            settings=dataclasses.replace(settings, floor=told))
    assert moved.ne_baseline[:2] == tuple(2 * floor.baseline_ne[o] for o in moved.seeds[:2])
    assert moved.plans["cut"].per_seed[:2] != reused.plans["cut"].per_seed[:2]
    # ... and a floor of another length, or from another card, is not reused.
    for other in (dataclasses.replace(told, training_steps=BUDGET.training_steps + 1),
                  dataclasses.replace(told, provenance={**told.provenance, "device_name": "another card"})):
        again = confirm_quality(workload, plans, budget=BUDGET, device="cpu",
                                settings=dataclasses.replace(settings, floor=other))
        assert again.ne_baseline == fresh.ne_baseline and again.provenance["baseline_from_noise_floor"] == []
    # What a job's estimate counts: one training per plan and seed, and the baseline's orders the floor lacks.
    budget = dataclasses.replace(BUDGET, noise_repeats=2, quality_scale=1, quality_seeds=3)
    assert quality_trainings(1, budget, floor=True) == 1 * 3 + 1
    assert quality_trainings(1, budget, floor=False) == 2 * 3
    assert quality_trainings(1, dataclasses.replace(budget, quality_scale=2), floor=True) == 2 * 3
    assert quality_trainings(0, budget, floor=True) == 0


def test_the_trial_command_measures_the_noise_floor_when_asked(tmp_path, capsys):
    from erase_tune.cli import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(ErasePlan(placements=(Placement(module="blocks.0", stream=1),), num_streams=1).dumps())
    argv = ["trial", "--workload", "tests.runtime.transformer:transformer_workload", "--arg", "batch=4",
            "--arg", "train_batches=4", "--arg", "eval_batches=1", "--plan", str(plan), "--device", "cpu",
            "--warmup", "5", "--windows", "1", "--window-steps", "1"]
    assert main([*argv, "--noise-floor", "1"]) == 0
    out = capsys.readouterr().out
    # --windows 1 is the least a trial times; the noise floor trains a trial's most: 5 + 20 × 1 steps.
    assert "noise floor of the NE gap: ±" in out and "(NE gap of the baseline against itself, 25 steps: order" in out
    assert "exact by construction" in out  # a placement detaches nothing: its gap is noise
    assert main([*argv, "--noise-floor", "-1"]) == 2  # refused before anything trains
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--noise-floor: -1 must be in 0..100" in err[0]


@pytest.mark.gpu
def test_on_cuda_the_whole_step_graph_is_one_of_the_perturbations(workload):
    floor = measure_noise_floor(workload, BUDGET, repeats=1, device="cuda")
    assert floor.kinds == ("order", "graph") and all(math.isfinite(g) for g in floor.gaps)
    assert floor.band == max(abs(g) for g in floor.gaps)
