"""The engine inside a step the user (here TorchRec's TrainPipelineSparseDist) owns: the
pipeline moves the data (copy to the device, input distribution of the next batch, started
before this batch's forward) and runs the optimizer; ``engine.forward_backward`` is its
forward and backward (``custom_model_fwd``; the pipeline's own backward then has nothing to
do). Trained over the same batches, the model ends bit-identical to one trained by
``engine.step``: the pipeline changes where the data moves, not what is computed."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")

import torch
from torch import nn
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from erase_tune import Cut, EraseEngine, ErasePlan
from tests.torchrec.models import DLRMTrain, dlrm, dmp, one_rank_group, sgd, train_batch

PLAN = ErasePlan(cuts=(Cut(module="model.dense_arch", aux_weight=0.5),), dispatch="blocking")
"""Named as on the bare DLRMTrain (as a study tuned it); under_wrapper() finds it under DMP."""
STEPS = 5


class ErasePipeline(TrainPipelineSparseDist):
    """TrainPipelineSparseDist whose forward and backward are one ``engine.forward_backward``."""

    def __init__(self, engine: EraseEngine, device: torch.device) -> None:
        super().__init__(engine.model, engine.optimizer, device, custom_model_fwd=self._forward_backward)
        self.engine = engine

    def _forward_backward(self, batch):
        loss = self.engine.forward_backward((batch,), batch.labels)
        return loss, loss  # (what _backward gets, what progress() returns)

    def _backward(self, losses: torch.Tensor) -> None:
        pass  # forward_backward ran the backward passes (the cuts' early ones and the main one)


def engine_for(model: nn.Module, example) -> EraseEngine:
    return EraseEngine(model, PLAN.under_wrapper(model), loss_fn=nn.functional.binary_cross_entropy_with_logits, optimizer=sgd,
                       example=((example,), example.labels), output=lambda out: out[1][1],
                       model_loss=lambda out: out[0])


@pytest.mark.parametrize("wrap_dense", [False, True], ids=["no DDP", "DMP's DDP wrapper"])
def test_engine_inside_train_pipeline_sparse_dist_matches_engine_step(wrap_dense):
    batches = [train_batch(size=16, seed=s) for s in range(STEPS)]
    with one_rank_group():
        stepped = dmp(DLRMTrain(dlrm(device="meta")), wrap_dense=wrap_dense)
        piped = dmp(DLRMTrain(dlrm(device="meta")), wrap_dense=wrap_dense)
        inner = "_dmp_wrapped_module.module." if wrap_dense else "_dmp_wrapped_module."
        assert PLAN.under_wrapper(piped).cuts[0].module == inner + "model.dense_arch"
        for (n, a), b in zip(stepped.named_parameters(), piped.parameters()):
            assert torch.equal(a, b), n  # the same model twice

        with engine_for(stepped, batches[0]) as engine:
            step_losses = [float(engine.step((b,), b.labels)) for b in batches]

        engine = engine_for(piped, batches[0])
        pipeline = ErasePipeline(engine, torch.device("cpu"))
        it = iter(batches)
        pipe_losses = []
        while True:
            try:
                pipe_losses.append(float(pipeline.progress(it)))
            except StopIteration:
                break
        assert pipeline._pipelined_modules  # the sharded EBC ran on inputs distributed a step ahead
        engine.close()

    assert pipe_losses == step_losses and len(pipe_losses) == STEPS
    assert step_losses[-1] != step_losses[0]
    for (n, a), b in zip(stepped.named_parameters(), piped.parameters()):
        assert torch.equal(a, b), n
