"""Loss mistakes end in one line each, blamed on the loss, before any timing: through `trial`
(with and without cuts) and its command. (The driver never calls a workload's loss; a study's
trials fail with this line.)"""

from __future__ import annotations

import pytest
import torch

from erase_tune import Cut, ErasePlan, PlanError
from erase_tune.errors import EraseTuneError
from erase_tune.runtime.losscheck import check_loss
from erase_tune.measure.trial import Budget, run_trial
from tests.runtime.badloss import MISTAKES, workload
from tests.runtime.transformer import TinyGPT, gpt_batch

EXPECTED = {
    "none": "loss_fn returns a tensor of shape (64,), not a scalar",
    "sum": "loss_fn is not a mean over the batch",
    "shape": "loss_fn rejects the model's own output (4, 16, 48) float32 with target (4, 16) int64",
}
BUDGET = Budget(warmup_steps=5, windows=1, window_steps=1)


@pytest.mark.parametrize("mistake", sorted(EXPECTED))
def test_each_mistake_is_named_on_the_models_output(mistake):
    model = TinyGPT()
    inputs, target = gpt_batch(4)
    with pytest.raises(PlanError) as e:
        check_loss(model, inputs, target, MISTAKES[mistake])
    assert EXPECTED[mistake] in str(e.value) and "\n" not in str(e.value)
    if mistake == "sum":
        assert "reduction='sum'" in str(e.value)
    if mistake == "shape":
        assert "not about any cut or aux head" in str(e.value)


def test_a_mean_loss_passes_and_the_model_is_left_as_it_was():
    model = TinyGPT()
    model.train()
    inputs, target = gpt_batch(4)
    state = torch.random.get_rng_state()
    value = check_loss(model, inputs, target, MISTAKES["ok"])
    assert 0 < value < 10 and model.training and torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("plan", [ErasePlan(), ErasePlan(cuts=(Cut(module="blocks.1.mlp"),))],
                         ids=["no-cuts", "a-cut"])
@pytest.mark.parametrize("mistake", sorted(EXPECTED))
def test_run_trial_stops_before_timing_with_the_loss_blamed(mistake, plan):
    with pytest.raises(EraseTuneError) as e:
        run_trial(workload(mistake), plan, BUDGET, device="cpu")
    text = str(e.value)
    assert text.startswith("workload tests.runtime.badloss:workload: ") and EXPECTED[mistake] in text
    assert "aux head's output" not in text  # not blamed on the cut's head


@pytest.mark.parametrize("mistake", sorted(EXPECTED))
def test_the_trial_command_prints_one_line_and_exits_2(mistake, tmp_path, capsys):
    from erase_tune.cli import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(ErasePlan(cuts=(Cut(module="blocks.0"),)).dumps())
    code = main(["trial", "--workload", "tests.runtime.badloss:workload", "--arg", f"mistake={mistake}",
                 "--plan", str(plan), "--device", "cpu", "--warmup", "5", "--windows", "1", "--window-steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and EXPECTED[mistake] in err[0], err
