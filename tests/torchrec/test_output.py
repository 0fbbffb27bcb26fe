"""A model whose forward returns a structure: ``output=`` says which part is the prediction
and ``model_loss=`` which is the loss a model computes itself. TorchRec's ``DLRMTrain``
returns ``(loss, (loss, logits, labels))`` with the logits detached: its own loss is the main
loss, the logits size the aux heads, and the gradients under a cut are exact. Without a
selector, or with one that does not fit, the engine says so in one line."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")

import copy

import torch
from torch import nn

from erase_tune import Cut, EraseEngine, EraseTuneError, ErasePlan, PlanError
from erase_tune.runtime.probing import probe
from tests.torchrec.models import DLRMTrain, dlrm, sgd, train_batch


def logits(out):
    """DLRMTrain's forward returns (loss, (loss, logits, labels)): the logits are the prediction."""
    return out[1][1]


def own_loss(out):
    """... and the loss it computes is the main loss (the logits in the tuple are detached)."""
    return out[0]


bce = nn.functional.binary_cross_entropy_with_logits  # the loss DLRMTrain computes itself
CUT = ErasePlan(cuts=(Cut(module="model.dense_arch", aux_weight=0.5),), dispatch="blocking")


def test_dlrm_train_with_output_selector_is_exact():
    b = train_batch()
    model = DLRMTrain(dlrm()).double()
    b = type(b)(dense_features=b.dense_features.double(), sparse_features=b.sparse_features, labels=b.labels.double())
    reference = copy.deepcopy(model)
    engine = EraseEngine(model, CUT, loss_fn=bce, optimizer=sgd, example=((b,), b.labels), output=logits,
                         model_loss=own_loss)
    assert engine.heads["model.dense_arch"].squeeze  # sized on the (B,) logits, not on the tuple
    total = engine.forward_backward((b,), b.labels)

    head = copy.deepcopy(engine.heads["model.dense_arch"])
    aux = []
    arch = reference.model.dense_arch
    arch.register_forward_pre_hook(lambda m, args: tuple(a.detach() for a in args))
    arch.register_forward_hook(lambda m, args, out: aux.append(0.5 * bce(head(out), b.labels)) or out.detach())
    main, _ = reference(b)
    (main + sum(aux)).backward()
    torch.testing.assert_close(total, (main + sum(aux)).detach(), rtol=0, atol=1e-12)
    got = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=0, atol=1e-12, msg=name)
    engine.close()


def test_dlrm_train_trains_with_a_selector():
    b = train_batch(size=32)
    with EraseEngine(DLRMTrain(dlrm()), CUT, loss_fn=bce, optimizer=sgd, example=((b,), b.labels),
                     output=logits, model_loss=own_loss) as engine:
        losses = [float(engine.step((b,), b.labels)) for _ in range(30)]
    assert losses[-1] < losses[0]


def test_a_structured_output_without_selector_is_one_line():
    b = train_batch()
    with pytest.raises(PlanError) as e:
        EraseEngine(DLRMTrain(dlrm()), CUT, loss_fn=bce, optimizer=sgd, example=((b,), b.labels))
    assert str(e.value) == ("cut 'model.dense_arch': the model returns tuple, not one tensor, so the default aux head "
                            "cannot match it: pass output= to pick the prediction out of it (or make_head with a head "
                            "for this output)")


def test_a_detached_prediction_without_model_loss_is_one_line():
    b = train_batch()
    with EraseEngine(DLRMTrain(dlrm()), CUT, loss_fn=bce, optimizer=sgd, example=((b,), b.labels),
                     output=logits) as engine:
        with pytest.raises(EraseTuneError, match=r"^output=: the prediction it picks is detached in the model's "
                                                 r"output.*pass model_loss= .*\(DLRMTrain: lambda out: out\[0\]\)$"):
            engine.step((b,), b.labels)


@pytest.mark.parametrize("select, says", [
    (lambda out: out[2], "output=: fails on the model's output (a tuple): IndexError: tuple index out of range"),
    (lambda out: out[1], "output=: returns tuple from the model's output (a tuple), but the prediction must be one "
                         "tensor"),
])
@pytest.mark.parametrize("which", ["output", "model_loss"])
def test_a_selector_that_does_not_fit_is_one_line(select, says, which):
    b = train_batch()
    says = says.replace("output=", f"{which}=", 1)
    if which == "model_loss":
        says = says.replace("the prediction must", "the loss must")
    elif says.endswith("one tensor"):
        says += " (or a dict of them, one per task)"
    kw = {"output": logits, "model_loss": own_loss, which: select}
    with pytest.raises(EraseTuneError) as e:
        EraseEngine(DLRMTrain(dlrm()), CUT, loss_fn=bce, optimizer=sgd, example=((b,), b.labels), **kw)
    assert str(e.value) == says
    with pytest.raises(EraseTuneError) as e:  # the service's probe of a workload's candidates says the same
        probe(DLRMTrain(dlrm()), (b,), ["model.dense_arch"], **kw)
    assert str(e.value) == says


WORKLOAD = '''
import functools
import torch
from torch import nn
from torchrec.models.dlrm import DLRMTrain
from erase_tune.workloads import Workload, WorkloadData
from tests.torchrec.models import dlrm, train_batch


def _data(device):
    batches = [((train_batch(size=16, seed=s),), train_batch(size=16, seed=s).labels) for s in range(4)]
    return WorkloadData(train=batches, eval=batches[:2], prior_entropy=0.69)


def workload() -> Workload:
    return Workload(name="dlrm_train:workload", args={}, build_model=lambda: DLRMTrain(dlrm()),
                    loss_fn=nn.functional.binary_cross_entropy_with_logits, make_data=_data,
                    cut_candidates=("model.dense_arch",), batch_size=16,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    output=lambda out: out[1][1], model_loss=lambda out: out[0])
'''


def test_a_workload_says_which_output_is_the_prediction_and_which_the_loss(tmp_path):
    """``erase-tune trial`` on a DLRMTrain workload: the workload's output= and model_loss= reach
    the engine, the plain baseline and held-out NE."""
    import os
    import subprocess
    import sys

    from tests.tune.conftest import ROOT

    (tmp_path / "dlrm_train.py").write_text(WORKLOAD)
    (tmp_path / "plan.yaml").write_text("cuts:\n  - {module: model.dense_arch}\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "erase_tune", "trial", "--workload", "dlrm_train:workload",
                           "--plan", "plan.yaml", "--device", "cpu", "--quality-steps", "8"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "plan: model.dense_arch@s0" in done.stdout and "NE gap" in done.stdout
