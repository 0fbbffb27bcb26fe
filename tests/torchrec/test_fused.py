"""Tables updated inside backward (TorchRec's in-backward optimizer on an unsharded EBC; the
fused kernel of tables sharded by DistributedModelParallel): they count as trained when a loss
reaches them, whatever their ``.grad`` says, and a plan that cuts them off is refused, wrapped
in DMP or not. DMP trains under any plan that fits, with its DDP wrapper (stood down while the
engine averages the dense gradients itself) or without."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")

import torch
from torchrec.optim import apply_optimizer_in_backward

from erase_tune import Cut, EraseEngine, EraseTuneError, ErasePlan, PlanError
from erase_tune.runtime import Placement
from tests.torchrec.models import batch, dlrm, dmp, logits_loss, one_rank_group, sgd, table_weights
from tests.torchrec.test_models import flat_head

PLANS = {
    "placement only": ErasePlan(placements=(Placement(module="sparse_arch", stream=1),), num_streams=1),
    "dense cut": ErasePlan(cuts=(Cut(module="dense_arch"),), dispatch="blocking"),
    "both towers cut": ErasePlan(cuts=(Cut(module="dense_arch"), Cut(module="sparse_arch")), dispatch="deferred"),
}
STARVING = ErasePlan(cuts=(Cut(module="dense_arch"), Cut(module="inter_arch")), dispatch="deferred")
TABLES = [f"sparse_arch.embedding_bag_collection.embedding_bags.t{i}.weight" for i in range(3)]


def in_backward_dlrm():
    model = dlrm()
    apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": 0.1})
    return model


@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_in_backward_optimizer_tables_train_under_any_plan(plan):
    dense, kjt, labels = batch()
    # The same first step in a plain loop: the tables move only by the main loss's gradient
    # (a cut of dense_arch changes none of it; a cut of sparse_arch adds its local loss).
    plain = in_backward_dlrm()
    logits_loss(plain(dense, kjt), labels).backward()
    model = in_backward_dlrm()
    before = table_weights(model)
    with EraseEngine(model, plan, loss_fn=logits_loss, optimizer=sgd, example=((dense, kjt), labels),
                     make_head=flat_head) as engine:
        engine.step((dense, kjt), labels)
        after = table_weights(model)
        for name in TABLES:
            assert model.get_parameter(name).grad is None  # applied in backward, then dropped
            assert not torch.equal(after[name], before[name]), name
            if not plan.cuts or plan.cuts[-1].module == "dense_arch":
                torch.testing.assert_close(after[name], plain.get_parameter(name).detach(), rtol=0, atol=0)
        for _ in range(2):
            assert torch.isfinite(engine.step((dense, kjt), labels))


def test_cutting_off_in_backward_tables_is_refused():
    dense, kjt, labels = batch()
    with pytest.raises(PlanError, match=r"^plan leaves 3 parameters untrained: " + TABLES[0]):
        EraseEngine(in_backward_dlrm(), STARVING, loss_fn=logits_loss, optimizer=sgd, example=((dense, kjt), labels))


def test_dmp_with_its_ddp_wrapper_trains_under_a_cut_and_gives_the_wrapper_back():
    """DMP's default: the dense part in DistributedDataParallel. The engine stands the wrapper
    down while it runs (tests/torchrec/test_dmp.py: the gradients, at one and two ranks) and a
    plan with nothing to cut or place leaves it alone: DDP trains as in a plain loop there."""
    dense, kjt, labels = batch()
    with one_rank_group():
        model = dmp(dlrm(device="meta"), wrap_dense=True)
        plan = ErasePlan(cuts=(Cut(module="_dmp_wrapped_module.module.dense_arch"),), dispatch="blocking")
        with EraseEngine(model, plan, loss_fn=logits_loss, optimizer=sgd, example=((dense, kjt), labels),
                         make_head=flat_head) as engine:
            assert "forward" in model._dmp_wrapped_module.__dict__
            assert torch.isfinite(engine.step((dense, kjt), labels))
        assert "forward" not in model._dmp_wrapped_module.__dict__
        with EraseEngine(model, ErasePlan(), loss_fn=logits_loss, optimizer=sgd) as engine:
            assert "forward" not in model._dmp_wrapped_module.__dict__
            assert torch.isfinite(engine.step((dense, kjt), labels))


def test_dmp_without_ddp_trains_its_fused_tables_and_refuses_starving_them():
    dense, kjt, labels = batch()
    with one_rank_group():
        model = dmp(dlrm(device="meta"), wrap_dense=False)
        example = ((dense, kjt), labels)
        # The plan names modules as DMP does; the bare name is pointed there.
        with pytest.raises(PlanError, match=r"no submodule 'dense_arch'; under its wrapper it is "
                                            r"'_dmp_wrapped_module\.dense_arch'$"):
            EraseEngine(model, ErasePlan(cuts=(Cut(module="dense_arch"),)), loss_fn=logits_loss, example=example)
        wrapped = {name: ErasePlan(cuts=tuple(Cut(module=f"_dmp_wrapped_module.{c.module}") for c in plan.cuts),
                                   placements=tuple(Placement(module=f"_dmp_wrapped_module.{p.module}", stream=p.stream)
                                                    for p in plan.placements),
                                   num_streams=plan.num_streams, dispatch=plan.dispatch)
                   for name, plan in {**PLANS, "starving": STARVING}.items()}
        with pytest.raises(PlanError, match=r"^plan leaves 3 parameters untrained: " + TABLES[0]):
            EraseEngine(model, wrapped.pop("starving"), loss_fn=logits_loss, optimizer=sgd, example=example)
        for name, plan in wrapped.items():
            before = table_weights(model)
            assert sorted(before) == TABLES  # DMP's parameter names have no prefix
            with EraseEngine(model, plan, loss_fn=logits_loss, optimizer=sgd, example=example,
                             make_head=flat_head) as engine:
                engine.step((dense, kjt), labels)
            after = table_weights(model)
            assert all(not torch.equal(after[n], before[n]) for n in TABLES), name


def test_sharded_tables_are_not_averaged_by_the_engine():
    dense, kjt, labels = batch()
    with one_rank_group():
        model = dmp(dlrm(device="meta"), wrap_dense=False)
        with pytest.raises(EraseTuneError) as e:
            EraseEngine(model, ErasePlan(), loss_fn=logits_loss, optimizer=sgd,
                        process_group=torch.distributed.group.WORLD)
        assert str(e.value).startswith("module '_dmp_wrapped_module.sparse_arch.embedding_bag_collection' is sharded "
                                       "by TorchRec (ShardedEmbeddingBagCollection)")
