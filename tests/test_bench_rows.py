"""``erase-tune bench`` finds its own way on models users bring: with no ``--cuts`` it cuts what
can be cut together and says what it left out; a row that cannot run on the model is skipped
with one line saying why and the rest are printed (on the CPU; the capture of a row's CUDA
graphs is tried on the GPU)."""

from __future__ import annotations

import dataclasses

import pytest

from erase_tune.measure.bench import ONE_CUT, ONE_PLACEMENT, run_bench
from erase_tune.cli import main
from erase_tune.measure.trial import Budget
from tests.gated import workload as gated

QUICK = ["--warmup", "5", "--windows", "2", "--window-steps", "2", "--streams", "2"]
DEEPFM = ["--arg", "batch=64", "--arg", "num_fields=4", "--arg", "rows=20", "--arg", "emb_dim=4", "--arg", "mlp=8-8",
          "--arg", "train_batches=16", "--arg", "eval_batches=2"]


def _bench(capsys, *argv: str, device: str = "cpu") -> tuple[int, str]:
    code = main(["bench", *argv, *QUICK, "--device", device])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out


def test_sibling_branches_are_cut_together_as_far_as_they_can_be_and_the_rest_is_named(capsys):
    code, out = _bench(capsys, "--workload", "deepfm", *DEEPFM)
    assert code == 0
    # linear and mlp are cut together; with fm cut too nothing would train the shared embedding.
    assert "cuts linear, mlp;" in out
    assert ("not cut: fm: plan leaves 1 parameters untrained: embedding.embedding.weight (cuts 'mlp', 'fm' together "
            "detach everything upstream of them)") in out
    for row in ("plain loop", "eager baseline", ONE_PLACEMENT, ONE_CUT, "ERASE blocking", "ERASE threaded"):
        assert f"\n{row}" in out, out
    assert "skipped" not in out


def test_the_one_cut_row_cuts_a_candidate_that_can_be_cut_alone():
    """The cheapest candidate (``tower``) can be cut only together with the gate above it: the
    host-cost rows place it, but cut the cheapest one that can be cut alone (``gate``). With the
    gate and the tower cut, cutting ``wide`` too would leave the main loss nothing to train."""
    result = run_bench(gated(), budget=Budget(warmup_steps=5, windows=2, window_steps=2), device="cpu", streams=2)
    rows = {r.name: r for r in result.rows}
    assert rows[ONE_PLACEMENT].plan.startswith("tower@s1(placed)")
    assert rows[ONE_CUT].plan.startswith("gate@s1;")
    assert result.provenance["cuts"] == ["gate", "tower"] and result.skipped == ()
    assert result.left_out == (("wide", "cuts 'gate', 'tower', 'wide' together cut the model's output off every "
                                        "parameter: the main loss would have no gradient path"),)


def test_rows_that_cannot_run_are_skipped_with_one_line_each_and_the_rest_printed(capsys):
    code, out = _bench(capsys, "--workload", "tests.gated:workload", "--cuts", "tower")
    assert code == 0
    why = ("plan leaves 2 parameters untrained: gate.0.weight, gate.0.bias (cut 'tower' detaches everything upstream "
           "of it)")
    for row in (ONE_CUT, "ERASE blocking", "ERASE threaded"):
        assert f"skipped {row}: {why}\n" in out, out
    rows = [line.split("  ")[0] for line in out.splitlines()]
    assert {"plain loop", "eager baseline", ONE_PLACEMENT} <= set(rows)
    assert "ERASE blocking" not in rows and ONE_CUT not in rows


def test_a_model_with_no_candidate_that_can_be_cut_still_gets_its_other_rows():
    only_tower = dataclasses.replace(gated(), cut_candidates=("tower",))
    result = run_bench(only_tower, budget=Budget(warmup_steps=5, windows=2, window_steps=2), device="cpu", streams=2)
    why = "plan leaves 2 parameters untrained: gate.0.weight, gate.0.bias (cut 'tower' detaches everything upstream of it)"
    assert result.skipped == (("ERASE rows", f"no candidate can be detached (tower: {why})"), (ONE_CUT, why))
    assert [r.name for r in result.rows] == ["plain loop", "eager baseline", ONE_PLACEMENT]


def test_sibling_cuts_given_by_hand_that_starve_the_embedding_skip_the_erase_rows(capsys):
    code, out = _bench(capsys, "--workload", "deepfm", *DEEPFM, "--cuts", "fm,mlp")
    assert code == 0
    assert ("skipped ERASE blocking: plan leaves 1 parameters untrained: embedding.embedding.weight (cuts 'fm', "
            "'mlp' together detach everything upstream of them)") in out
    assert "\neager baseline" in out and f"\n{ONE_PLACEMENT}" in out


@pytest.mark.parametrize("cuts, message", [
    ("nothere", "module 'nothere'"),
    ("tower,tower", "overlaps"),
])
def test_a_cut_that_names_no_module_is_still_the_users_mistake(capsys, cuts, message):
    code = main(["bench", "--workload", "tests.gated:workload", "--cuts", cuts, *QUICK, "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


@pytest.mark.gpu
def test_a_row_whose_graphs_cannot_be_captured_is_skipped_with_its_reason(capsys):
    """The gate copies host data in every forward: the whole step and any graph holding the gate
    cannot be captured. The per-cut-graph row is tried once, skipped with the capture's reason,
    and every eager row is printed."""
    code, out = _bench(capsys, "--workload", "tests.gated:workload", "--arg", "host_copy=true", device="cuda")
    assert code == 0
    assert out.count("graph rows left out") == 1
    assert "skipped ERASE per-cut graphs: " in out and "capture" in out
    assert "\nERASE blocking" in out and "\nERASE threaded" in out and "\neager baseline" in out
