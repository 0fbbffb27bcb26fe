"""On the GPU: a model whose step cannot be captured whole is measured without the whole-step
graph reference (its reason recorded and shown once), and the process measures on afterwards:
a capturable workload's trial in the same process still gets its reference."""

from __future__ import annotations

import pytest
import torch

from erase_tune.measure.bench import GRAPH, HOST_ROWS, run_bench
from erase_tune.cli import main
from erase_tune.runtime import Cut, ErasePlan
from erase_tune.measure.trial import Budget, reference_capture_error, run_trial
from erase_tune.tune.views.tables import trial_table
from erase_tune.workloads import get_workload
from tests.host_index import workload

pytestmark = pytest.mark.gpu

BUDGET = Budget(warmup_steps=5, windows=2, window_steps=3, quality_steps=2)
PLAN = ErasePlan(cuts=(Cut(module="left", stream=1),), num_streams=1)
TINY_CTR = {"batch": 64, "width": 8, "depth": 1, "emb_dim": 4, "num_tables": 4, "rows": 50, "sub_out": 4,
            "train_batches": 16, "eval_batches": 2}


@pytest.mark.parametrize("sync", [False, True], ids=["host-index", "host-index-and-sync"])
def test_a_step_that_cannot_be_captured_whole_does_not_fail_the_trial(sync):
    result = run_trial(workload(sync=sync), PLAN, BUDGET, device="cuda")
    assert result.reference_error is not None and "whole-step CUDA graph capture failed" in result.reference_error
    assert "reference" not in result.variants and result.gain_vs_reference is None
    assert set(result.variants) == {"baseline", "candidate", "detach_only"} and result.ne_baseline > 0
    assert trial_table(result).count(result.reference_error) == 1

    # Nothing left behind: the CUDA RNG draws, and a capturable workload still gets its reference.
    torch.randn(8, device="cuda")
    ctr = get_workload("ctr", TINY_CTR)
    assert reference_capture_error(ctr, "cuda") is None
    again = run_trial(ctr, ErasePlan(cuts=(Cut(module="subarchs.0", stream=1),), num_streams=1), BUDGET,
                      device="cuda")
    assert again.reference_error is None and "reference" in again.variants and again.gain_vs_reference is not None


def test_reference_off_is_not_tried():
    result = run_trial(workload(), PLAN, Budget(warmup_steps=5, windows=1, window_steps=2, reference=False),
                       device="cuda")
    assert result.reference_error is None and "reference" not in result.variants


def test_bench_drops_its_graph_rows_with_one_line(capsys):
    result = run_bench(workload(), budget=Budget(warmup_steps=5, windows=2, window_steps=3), device="cuda",
                       streams=1)
    names = [r.name for r in result.rows]
    assert result.graph_error is not None and "whole-step CUDA graph capture failed" in result.graph_error
    assert GRAPH not in names and not any(n.startswith("graph +") for n in names)
    assert set(HOST_ROWS) <= set(names) and "ERASE per-cut graphs" in names
    assert all(r.vs_graph is None for r in result.rows)

    assert main(["bench", "--workload", "tests.host_index:workload", "--device", "cuda", "--warmup", "5",
                 "--windows", "1", "--window-steps", "2", "--streams", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("graph rows left out") == 1 and "host cost" in out and "graph baseline" not in out


def test_the_noise_floor_of_a_step_that_cannot_be_captured_whole_leaves_the_graph_out():
    """Seen on an H200 with the dlrm workload: the noise floor used to fail outright there."""
    from erase_tune.measure.noise import measure_noise_floor

    floor = measure_noise_floor(workload(), BUDGET, repeats=2, device="cuda")
    assert floor.kinds == ("order", "order") and len(floor.gaps) == 2
    assert "whole-step CUDA graph capture failed" in floor.provenance["graph_left_out"]
