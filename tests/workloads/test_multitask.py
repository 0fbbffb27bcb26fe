"""Multi-task models (issue 29 item 6): several outputs, a loss and an NE per task, an aux head
per task under each cut, and a plan check that never lets a head/loss mismatch reach training.

The model is ``tests.multitask``: a shared bottom, a click tower ending in a sigmoid (BCE on
probabilities) and a conversion tower ending in a logit (BCE on logits, weight 2); the target
is (B, 2), one label column per task."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from erase_tune import Cut, EraseEngine, ErasePlan, PlanError
from erase_tune.cli import main
from erase_tune.errors import EraseTuneError
from erase_tune.measure.trial import Budget, run_trial
from erase_tune.runtime.heads import LinearHead, TaskHeads
from erase_tune.workloads import Task, Workload
from erase_tune.workloads.base import prior_entropy
from tests.multitask import TASKS, workload

CPU = torch.device("cpu")


def _engine(wl: Workload, model: nn.Module, plan: ErasePlan, example, make_head=None) -> EraseEngine:
    return EraseEngine(model, plan, loss_fn=wl.loss_fn, optimizer=wl.optimizer, example=example,
                       make_head=make_head or wl.make_head, output=wl.output)


def _by_hand(preds, target, click_w=1.0, conv_w=2.0):
    """The two tasks' losses, written out: BCE on the click probability against column 0,
    2 x BCE on the conversion logit against column 1."""
    click, conversion = preds
    return (click_w * F.binary_cross_entropy(click, target[:, 0])
            + conv_w * F.binary_cross_entropy_with_logits(conversion, target[:, 1]))


@pytest.mark.parametrize("dispatch", ["blocking", "deferred"])
def test_engine_gradients_equal_a_hand_written_reference(dispatch):
    wl = workload(batch=32, steps=2)
    model = wl.build_model().double()
    (x,), target = wl.make_data(CPU).batch(0)
    x, target = x.double(), target.double()
    plan = ErasePlan(cuts=(Cut(module="bottom", aux_weight=0.5), Cut(module="conversion.0")), dispatch=dispatch)
    reference = copy.deepcopy(model)
    engine = _engine(wl, model, plan, ((x,), target))
    engine.forward_backward((x,), target)

    heads = {name: copy.deepcopy(h) for name, h in engine.heads.items()}
    aux = []
    for cut in plan.cuts:
        module = reference.get_submodule(cut.module)
        module.register_forward_pre_hook(lambda m, args: tuple(a.detach() for a in args))

        def local(m, args, out, cut=cut):
            click_head, conversion_head = heads[cut.module].heads  # one head per task, in task order
            aux.append(cut.aux_weight * _by_hand((click_head(out), conversion_head(out)), target))
            return out.detach()

        module.register_forward_hook(local)
    (_by_hand(reference(x), target) + sum(aux)).backward()

    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert got.grad is not None and torch.allclose(got.grad, want.grad, rtol=0, atol=1e-12), name
    for name, head in engine.heads.items():
        for got, want in zip(head.parameters(), heads[name].parameters()):
            assert torch.allclose(got.grad, want.grad, rtol=0, atol=1e-12), name
    engine.close()


def test_default_heads_repeat_each_towers_activation_and_train_with_bce():
    wl = workload(batch=32, steps=16)
    data = wl.make_data(CPU)
    model = wl.build_model()
    plan = ErasePlan(cuts=tuple(Cut(module=m) for m in wl.cut_candidates), dispatch="blocking")
    engine = _engine(wl, model, plan, data.batch(0))
    for name, head in engine.heads.items():
        assert isinstance(head, TaskHeads) and head.names == ("click", "conversion"), name
        assert [h.activation for h in head.heads] == ["sigmoid", "none"], name
        with torch.no_grad():
            pred = head(torch.randn(5, 32) * 100)  # far from the example: the click head still gives probabilities
        assert 0 <= float(pred["click"].min()) and float(pred["click"].max()) <= 1
    losses = [float(engine.step(*data.batch(s))) for s in range(40)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) < sum(losses[:5])  # it trains
    engine.close()


def test_each_tasks_ne_is_against_its_own_columns_prior():
    wl = workload(batch=32, steps=8)
    data = wl.make_data(CPU)
    model = wl.build_model()
    got = wl.normalized_entropies(model, data)
    labels = torch.cat([t for _, t in data.train])
    priors = {"click": prior_entropy(labels[:, 0]), "conversion": prior_entropy(labels[:, 1])}
    assert priors["conversion"] < priors["click"] - 0.1  # conversions are rarer: pooling would blur them
    with torch.no_grad():
        n = sum(len(t) for _, t in data.eval)
        want = {
            "click": sum(float(F.binary_cross_entropy(model(x)[0], t[:, 0])) * len(t) for (x,), t in data.eval)
            / n / priors["click"],
            "conversion": sum(float(F.binary_cross_entropy_with_logits(model(x)[1], t[:, 1])) * len(t)
                              for (x,), t in data.eval) / n / priors["conversion"],
        }
    assert got == pytest.approx(want, rel=1e-12)
    assert wl.normalized_entropy(model, data) == got["click"]  # the main task's
    assert workload(batch=32, steps=8, main_task="conversion").normalized_entropy(model, data) == got["conversion"]


def _raw_heads(name, cut_out, model_out):
    """Raw linear heads for both tasks, their values 0.5 on any input (weights zero): in [0, 1] on
    the example batch, as a raw head's values may be there by chance, and nowhere after a step."""
    heads = {}
    for task in model_out:
        head = LinearHead(cut_out.shape[-1], 1, squeeze=True)
        nn.init.zeros_(head.proj.weight)
        nn.init.constant_(head.proj.bias, 0.5)
        heads[task] = head
    return TaskHeads(heads)


def test_a_head_whose_values_may_leave_the_bce_range_is_refused_before_training():
    wl = workload(batch=32, steps=4)
    data = wl.make_data(CPU)
    for cut in wl.cut_candidates:  # every plan, not one
        with pytest.raises(PlanError) as e:
            _engine(wl, wl.build_model(), ErasePlan(cuts=(Cut(module=cut),)), data.batch(0), make_head=_raw_heads)
        message = str(e.value)
        assert message.startswith(f"cut '{cut}': task 'click': the aux head's output does not end in a sigmoid")
        assert "\n" not in message
    # The same heads through a trial: one line before any step, naming the cut and the task.
    bad = dataclasses.replace(wl, make_head=_raw_heads)
    with pytest.raises(EraseTuneError, match="cut 'bottom': task 'click'"):
        run_trial(bad, ErasePlan(cuts=(Cut(module="bottom"),)), Budget(warmup_steps=5, windows=2, window_steps=1,
                                                                       quality_steps=2), device="cpu")


def test_a_head_missing_a_task_or_of_the_wrong_shape_is_one_line():
    wl = workload(batch=32, steps=4)
    example = wl.example(CPU)
    one_task = lambda name, out, model_out: TaskHeads({"click": LinearHead(out.shape[-1], 1, True, "sigmoid")})
    with pytest.raises(PlanError, match=r"^cut 'bottom': the aux head gives \['click'\], but the model's prediction "
                                        r"is one tensor per task \['click', 'conversion'\]"):
        _engine(wl, wl.build_model(), ErasePlan(cuts=(Cut(module="bottom"),)), example, make_head=one_task)
    wide = lambda name, out, model_out: TaskHeads({k: LinearHead(out.shape[-1], 3, False, "sigmoid") for k in model_out})
    with pytest.raises(PlanError, match=r"^cut 'bottom': task 'click' aux head maps output \(32, 32\) to \(32, 3\), "
                                        r"but the model's output for the task is \(32,\)"):
        _engine(wl, wl.build_model(), ErasePlan(cuts=(Cut(module="bottom"),)), example, make_head=wide)


def test_run_trial_reports_each_tasks_ne_gap_and_the_main_tasks_as_ne_gap():
    wl = workload(batch=32, steps=24)
    budget = Budget(warmup_steps=5, windows=2, max_windows=2, window_steps=2, quality_steps=24)
    result = run_trial(wl, ErasePlan(cuts=(Cut(module="bottom"),)), budget, device="cpu")
    tasks = result.ne_tasks
    assert tasks is not None and set(tasks) == {"click", "conversion"}
    for ne in tasks.values():
        assert ne["gap"] == pytest.approx((ne["candidate"] - ne["baseline"]) / ne["baseline"], rel=1e-12)
    assert result.ne_gap == tasks["click"]["gap"] and result.ne_baseline == tasks["click"]["baseline"]
    assert tasks["conversion"]["gap"] != tasks["click"]["gap"]
    assert result.to_dict()["ne_tasks"] == tasks and result.provenance["main_task"] == "click"
    other = run_trial(workload(batch=32, steps=24, main_task="conversion"), ErasePlan(cuts=(Cut(module="bottom"),)),
                      budget, device="cpu")
    assert other.ne_gap == other.ne_tasks["conversion"]["gap"]
    assert other.ne_tasks == tasks  # the same training: the main task only picks ne_gap
    # A baseline NE cached by a study is the main task's alone: the baseline still trains for each task's.
    cached = run_trial(wl, ErasePlan(cuts=(Cut(module="bottom"),)), budget, device="cpu", baseline_ne=0.5)
    assert cached.ne_tasks == tasks and cached.provenance["baseline_ne_cached"] is False
    # A plan with no cuts: exact, every task's gap 0.
    exact = run_trial(wl, ErasePlan(), budget, device="cpu")
    assert exact.exact and {k: v["gap"] for k, v in exact.ne_tasks.items()} == {"click": 0.0, "conversion": 0.0}


def test_the_trial_command_shows_each_tasks_gap(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    ErasePlan(cuts=(Cut(module="bottom"),)).save(plan)
    args = ["--arg", "batch=32", "--arg", "steps=24"]
    budget = ["--warmup", "5", "--windows", "2", "--window-steps", "2", "--quality-steps", "24"]
    code = main(["trial", "--workload", "tests.multitask:workload", *args, "--plan", str(plan), "--device", "cpu",
                 *budget])
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("NE per task"))
    assert line.startswith("NE per task (main click): click ") and ", conversion " in line, line


@pytest.mark.parametrize(("change", "message"), [
    ({"main_task": "purchase"}, "main_task='purchase' is not a task ('click', 'conversion')"),
    ({"tasks": (TASKS[0], TASKS[0])}, "tasks=: task names must be unique, 'click' appears twice"),
    ({"loss_fn": F.binary_cross_entropy}, "tasks= replaces loss_fn=: each task has its own loss_fn"),
    ({"output": lambda out: out[0]}, "tasks= replaces output=: each task picks its own prediction"),
    ({"model_loss": lambda out: out[0]}, "tasks= and model_loss= do not go together"),
])
def test_an_inconsistent_multi_task_workload_is_one_line(change, message):
    wl = workload()
    fields = {f.name: getattr(wl, f.name) for f in dataclasses.fields(wl) if f.name not in ("loss_fn", "output")}
    with pytest.raises(ValueError) as e:
        Workload(**{**fields, **change})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": ""}, "Task: name must be a non-empty string"),
    ({"label": -1}, "task 'click': label must be a column index >= 0 or a function of the target, got -1"),
    ({"label": "0"}, "task 'click': label must be a column index"),
    ({"weight": 0}, "task 'click': weight must be a finite number > 0, got 0"),
    ({"loss_fn": "bce"}, "task 'click': loss_fn must be callable"),
])
def test_a_bad_task_is_one_line(kwargs, message):
    fields = {"name": "click", "output": lambda out: out[0], "loss_fn": F.binary_cross_entropy, "label": 0}
    with pytest.raises(ValueError) as e:
        Task(**{**fields, **kwargs})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_bad_task_definitions_through_the_command_are_one_line_exit_2(tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    ErasePlan(cuts=(Cut(module="bottom"),)).save(plan)
    code = main(["trial", "--workload", "tests.multitask:workload", "--arg", "main_task=purchase", "--plan", str(plan),
                 "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "main_task='purchase' is not a task" in err, err


def test_a_label_column_the_target_lacks_is_one_line_naming_the_task():
    wl = workload(batch=32, steps=4)
    third = Task(name="purchase", output=lambda out: out[1], loss_fn=F.binary_cross_entropy_with_logits, label=2)
    bad = dataclasses.replace(wl, tasks=(*TASKS, third), loss_fn=None, output=None)
    with pytest.raises(EraseTuneError) as e:
        run_trial(bad, ErasePlan(cuts=(Cut(module="bottom"),)), Budget(warmup_steps=5, windows=2, window_steps=1,
                                                                       quality_steps=2), device="cpu")
    assert "task 'purchase': label column 2 is not in the target (32, 2)" in str(e.value)
    assert "\n" not in str(e.value)


def _doc_files() -> dict[str, str]:
    """``path -> text`` of docs/workloads.md's ``# file:`` blocks."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "workloads.md").read_text()
    blocks = (body for _, body in re.findall(r"```(\w*)\n(.*?)```", page, re.S))
    return {b.splitlines()[0].removeprefix("# file: ").strip(): b for b in blocks if b.startswith("# file: ")}


@pytest.mark.parametrize("script", ["check_grads_tasks.py", "check_grads.py"])
def test_the_guides_gradient_checks_run_on_the_two_task_model_and_the_ranker(tmp_path, script):
    """docs/workloads.md's multi-task example and section 5's check, as written: the check takes
    the two-task model's list output, and still takes the single-output ranker."""
    import os
    import subprocess
    import sys

    files = _doc_files()
    for rel in ("my_tasks/__init__.py", "my_ranker/__init__.py", script):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(files[rel])
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}  # this checkout's erase_tune
    done = subprocess.run([sys.executable, script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "gradients match the reference" in done.stdout, done.stderr[-3000:]


def test_the_same_check_holds_for_a_single_output_model_ending_in_a_sigmoid():
    """One task, no tasks=: a raw head under BCE is refused whatever its values on the example."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid(), nn.Flatten(0))
    x, y = torch.randn(16, 8), torch.bernoulli(torch.full((16,), 0.3))

    def raw(name, cut_out, model_out):
        head = LinearHead(cut_out.shape[-1], 1, squeeze=True)
        nn.init.zeros_(head.proj.weight)
        nn.init.constant_(head.proj.bias, 0.5)
        return head

    with pytest.raises(PlanError, match=r"^cut '0': the aux head's output does not end in a sigmoid like the model's"):
        EraseEngine(model, ErasePlan(cuts=(Cut(module="0"),)), loss_fn=F.binary_cross_entropy, example=((x,), y),
                    make_head=raw)
    with_sigmoid = lambda name, cut_out, model_out: nn.Sequential(raw(name, cut_out, model_out), nn.Sigmoid())
    engine = EraseEngine(model, ErasePlan(cuts=(Cut(module="0"),)), loss_fn=F.binary_cross_entropy,
                         example=((x,), y), make_head=with_sigmoid)
    assert torch.isfinite(engine.step((x,), y))
    engine.close()
