"""The whole-step-graph reference on a model whose step cannot be captured whole, and the
host-cost rows of ``erase-tune bench``, on the CPU (the GPU side: tests/test_reference_gpu.py)."""

from __future__ import annotations

import math

from erase_tune.measure.bench import HOST_ROWS, PLAIN, cheapest, run_bench
from erase_tune.cli import main
from erase_tune.runtime import Cut, ErasePlan
from erase_tune.measure.trial import Budget, reference_capture_error, run_trial
from erase_tune.tune.views.tables import trial_table
from tests.host_index import HostIndexNet, workload

BUDGET = Budget(warmup_steps=5, windows=2, window_steps=2, quality_steps=2)
PLAN = ErasePlan(cuts=(Cut(module="left", stream=1),), num_streams=1)


def test_the_reference_is_not_tried_on_the_cpu():
    w = workload()
    assert reference_capture_error(w, "cpu") is None
    result = run_trial(w, PLAN, BUDGET, device="cpu")
    assert result.reference_error is None and "reference" not in result.variants
    assert "left out" not in trial_table(result)


def test_a_known_capture_error_leaves_the_reference_out_and_is_shown_once():
    reason = "whole-step CUDA graph capture failed (Cannot copy between CPU and CUDA tensors during CUDA graph capture)"
    result = run_trial(workload(), PLAN, BUDGET, device="cpu", reference_error=reason)
    assert result.reference_error == reason and result.gain_vs_reference is None
    assert set(result.variants) == {"baseline", "candidate", "detach_only"}
    assert result.to_dict()["reference_error"] == reason
    table = trial_table(result)
    assert table.count(reason) == 1 and f"whole-step-graph baseline left out: {reason}" in table.splitlines()


def test_cheapest_candidate_has_the_fewest_parameters():
    model = HostIndexNet(width=16)
    assert cheapest(["bottom", "left", "top"], model) == "left"
    assert cheapest(["bottom", "top"], model) == "top"  # 280 parameters against 209
    assert cheapest(["right", "left"], model) == "right"  # a tie: the first


def test_bench_host_cost_rows(capsys):
    result = run_bench(workload(), budget=Budget(warmup_steps=5, windows=2, window_steps=3), device="cpu",
                       streams=1)
    rows = {r.name: r for r in result.rows}
    assert set(HOST_ROWS) <= set(rows) and result.graph_error is None
    assert rows["one placement"].plan == "left@s1(placed); 1 side stream(s), blocking"
    assert rows["one cut (blocking)"].plan.startswith("left@s1;") and "blocking" in rows["one cut (blocking)"].plan
    assert rows[PLAIN].vs_plain_us == 0.0  # the plain loop against itself, window by window
    for name in HOST_ROWS:
        assert rows[name].ms_per_step > 0 and math.isfinite(rows[name].vs_plain_us)
    host = result.host_table().splitlines()
    assert [line.split("  ")[0].strip() for line in host[2:2 + len(HOST_ROWS)]] == list(HOST_ROWS)
    assert all("µs/step" in line for line in host[3:2 + len(HOST_ROWS)])
    # The host CPU pass: every host row has a CPU time; the plain loop's tax over itself is 0.
    assert all(rows[n].host_cpu_us > 0 for n in HOST_ROWS) and rows[PLAIN].host_tax_us == (0.0, 0.0, 0.0)
    assert host[-1].startswith("(host CPU:") and "cpu: no device waits" in host[-1]
    assert result.to_dict()["host_cpu"].startswith("cpu: no device waits; runners ")

    assert main(["bench", "--workload", "tests.host_index:workload", "--device", "cpu", "--warmup", "5",
                 "--windows", "1", "--window-steps", "2", "--streams", "1"]) == 0
    out = capsys.readouterr().out
    assert "host cost" in out and "one cut (blocking)" in out and "ERASE blocking" in out
    assert "graph rows left out" not in out
