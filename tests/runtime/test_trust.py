"""Plans that used to fail deep inside torch, or train a different model silently, are refused
before the first step with one line naming the target; valid plans on such models are exact."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from erase_tune import Cut, EraseEngine, EraseTuneError, ErasePlan, Placement, PlanError
from tests.runtime.dlrm import DLRM_Net, TwoTowerGate, dlrm_batch
from tests.runtime.models import loss_fn as logit_loss
from tests.runtime.models import toy_batch
from tests.runtime.test_engine import engine_grads, reference_grads

bce = nn.BCELoss()
sgd = functools.partial(torch.optim.SGD, lr=0.1)
DISPATCHES = ["blocking", "threaded", "deferred"]


def _dlrm_engine(plan: ErasePlan, **kw) -> EraseEngine:
    torch.manual_seed(0)
    kw.setdefault("optimizer", sgd)
    return EraseEngine(DLRM_Net(), plan, loss_fn=bce, example=dlrm_batch(), **kw)


def _refused(make, match: str) -> str:
    with pytest.raises(PlanError, match=match) as e:
        make()
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_a_cut_that_starves_everything_upstream_is_refused():
    message = _refused(lambda: _dlrm_engine(ErasePlan(cuts=(Cut(module="top_l.0:2"),))), "untrained")
    assert message.startswith("plan leaves 7 parameters untrained: emb_l.0.weight, emb_l.1.weight, emb_l.2.weight, "
                              "bot_l.0.weight, bot_l.0.bias, … (")
    assert message.endswith("(cut 'top_l.0:2' detaches everything upstream of it)")


def test_parallel_towers_are_not_a_chain():
    message = _refused(
        lambda: EraseEngine(TwoTowerGate(), ErasePlan(cuts=(Cut(module="towers.0:2"),)), loss_fn=logit_loss,
                            example=toy_batch()),
        "not a chain",
    )
    assert message.startswith("cut 'towers.0:2' is not a chain: towers.1 does not take towers.0's output")


def test_embedding_tables_are_not_a_chain():
    # Before the probe this reached EmbeddingBag with float input ("expected Long"), deep in torch.
    message = _refused(lambda: _dlrm_engine(ErasePlan(cuts=(Cut(module="emb_l.0:3"),))), "not a chain")
    assert message.startswith("cut 'emb_l.0:3' is not a chain: emb_l.1 does not take emb_l.0's output")


def test_a_run_placement_must_be_a_chain_too():
    plan = ErasePlan(placements=(Placement(module="towers.0:2", stream=1),), num_streams=1)
    _refused(lambda: EraseEngine(TwoTowerGate(), plan, loss_fn=logit_loss, example=toy_batch()),
             r"^placement 'towers.0:2' is not a chain: towers.1 does not take towers.0's output")


@pytest.mark.parametrize("dispatch", DISPATCHES)
def test_cutting_the_output_module_is_refused(dispatch):
    plan = ErasePlan(cuts=(Cut(module="top_l"),), dispatch=dispatch)
    _refused(lambda: _dlrm_engine(plan), r"^cut 'top_l' produces the model's output: detaching it leaves the main "
                                         "loss with no gradient path")


def test_a_module_the_forward_never_calls_is_refused():
    _refused(lambda: _dlrm_engine(ErasePlan(cuts=(Cut(module="loss_fn"),))),
             r"^cut 'loss_fn': the module is never called in DLRM_Net's forward$")
    plan = ErasePlan(placements=(Placement(module="loss_fn", stream=1),), num_streams=1)
    _refused(lambda: _dlrm_engine(plan), r"^placement 'loss_fn': the module is never called in DLRM_Net's forward$")


def test_a_cut_returning_a_tuple_is_refused():
    _refused(
        lambda: EraseEngine(TwoTowerGate(), ErasePlan(cuts=(Cut(module="moments"),)), loss_fn=logit_loss,
                            example=toy_batch()),
        r"^cut 'moments': the module returns tuple, but a cut must return one tensor",
    )


def test_cuts_that_together_cut_the_output_off_are_refused():
    # Each cut alone leaves the main loss the other tower; both together leave it nothing,
    # though every parameter still has a local loss.
    class Sum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.towers = nn.ModuleList(nn.Linear(8, 1) for _ in range(2))

        def forward(self, x):
            return (self.towers[0](x) + self.towers[1](x)).squeeze(-1)

    plan = ErasePlan(cuts=(Cut(module="towers.0"), Cut(module="towers.1")))
    _refused(lambda: EraseEngine(Sum(), plan, loss_fn=logit_loss, example=toy_batch()),
             r"^cuts 'towers.0', 'towers.1' together cut the model's output off every parameter")


def test_the_default_head_of_a_probability_model_gives_probabilities():
    engine = _dlrm_engine(ErasePlan(cuts=(Cut(module="bot_l"), Cut(module="emb_l.1"))))
    inputs, target = dlrm_batch(n=64, seed=1)
    for name, head in engine.heads.items():
        assert head.activation == "sigmoid", name
    with torch.no_grad():
        probs = engine.heads["bot_l"](engine.model.bot_l(inputs[0]))
    assert probs.shape == (64,) and bool(((probs > 0) & (probs < 1)).all())
    losses = [float(engine.step(*dlrm_batch(n=64, seed=s))) for s in range(30)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    engine.close()


def test_a_head_that_does_not_fit_the_loss_asks_for_make_head():
    logits = lambda name, out, model_out: nn.Sequential(nn.Linear(out.shape[-1], 1), nn.Flatten(0))  # noqa: E731
    _refused(lambda: _dlrm_engine(ErasePlan(cuts=(Cut(module="bot_l"),)), make_head=logits),
             r"^cut 'bot_l': loss_fn does not take the aux head's output \(.*\); pass make_head")


def test_a_loss_that_is_not_finite_on_the_head_is_refused():
    nan_loss = lambda out, y: bce(out, y) * float("nan")  # noqa: E731
    _refused(lambda: EraseEngine(DLRM_Net(), ErasePlan(cuts=(Cut(module="bot_l"),)), loss_fn=nan_loss,
                                 example=dlrm_batch(), optimizer=sgd),
             r"^cut 'bot_l': loss_fn gives tensor\(nan\) on the aux head's output for the example batch; pass make_head")


def test_adam_on_sparse_embeddings_is_one_line():
    inputs, target = dlrm_batch()
    for plan in (ErasePlan(), ErasePlan(cuts=(Cut(module="bot_l"),))):
        engine = _dlrm_engine(plan, optimizer=functools.partial(torch.optim.Adam, lr=1e-3))
        with pytest.raises(EraseTuneError) as e:
            engine.step(inputs, target)
        assert str(e.value) == (
            "optimizer Adam cannot take the sparse gradients of emb_l.0.weight, emb_l.1.weight, emb_l.2.weight: "
            "give them a sparse-capable optimizer (SparseAdam, SGD, Adagrad) in a separate param group or optimizer"
        )


def test_a_cut_embedding_bag_with_sparse_gradients_is_exact():
    torch.manual_seed(0)
    model = DLRM_Net().double()
    plan = ErasePlan(cuts=(Cut(module="emb_l.1", stream=1, aux_weight=0.7),), num_streams=1)
    inputs, target = dlrm_batch(dtype=torch.float64)
    pristine = copy.deepcopy(model)
    engine = EraseEngine(model, plan, loss_fn=bce, example=(inputs, target), optimizer=sgd)
    loss = engine.forward_backward(inputs, target)
    ref, ref_loss = reference_grads(pristine, engine.heads, plan, inputs, target, loss=bce)
    got = engine_grads(engine)
    assert got["model.emb_l.1.weight"].is_sparse
    for name, g in ref.items():
        assert g is not None, name
        torch.testing.assert_close(got[name].to_dense(), g.to_dense(), rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    engine.step(inputs, target)  # SGD takes the sparse gradients
    engine.close()


def test_starvation_the_probe_cannot_see_is_caught_after_the_first_step():
    # In eval mode (the probe) Dropout returns its input itself, so a cut on it looks like a
    # no-op; in training its output is a new tensor, detaching it starves the encoder.
    class Encoded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(8, 16)
            self.drop = nn.Dropout(0.1)
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            return self.head(self.drop(torch.relu(self.enc(x)))).squeeze(-1)

    engine = EraseEngine(Encoded(), ErasePlan(cuts=(Cut(module="drop"),)), loss_fn=logit_loss, example=toy_batch())
    before = copy.deepcopy(engine.model.state_dict())
    with pytest.raises(PlanError, match=r"^plan leaves 2 parameters untrained: enc.weight, enc.bias"):
        engine.step(*toy_batch())
    for name, value in engine.model.state_dict().items():  # refused before the optimizer ran
        assert torch.equal(value, before[name]), name


def test_a_plan_without_cuts_or_placements_does_not_probe():
    calls = []

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            calls.append(1)
            return self.b(torch.tanh(self.a(x))).squeeze(-1)

    EraseEngine(Counting(), ErasePlan(), loss_fn=logit_loss, example=toy_batch())
    assert calls == []
    EraseEngine(Counting(), ErasePlan(cuts=(Cut(module="a"),)), loss_fn=logit_loss, example=toy_batch())
    assert len(calls) == 1  # one probe forward, for the checks and the heads together


def test_an_aux_weight_the_cuts_dtype_cannot_hold_is_one_line():
    """λ = 1e-6 is a fine float32 but below float16's smallest normal: the piece would not train."""
    from erase_tune import Cut, EraseEngine, ErasePlan, PlanError
    from tests.runtime.models import Toy, loss_fn, toy_batch

    model = Toy().half()
    with pytest.raises(PlanError, match=r"cut 'towers.0': aux_weight 1e-06 is below the smallest normal float16"):
        EraseEngine(model, ErasePlan(cuts=(Cut(module="towers.0", aux_weight=1e-6),)), loss_fn=loss_fn,
                    example=toy_batch(dtype=torch.float16))
