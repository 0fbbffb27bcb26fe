"""One rank of the DistributedModelParallel test (tests/torchrec/test_dmp.py starts two, gloo).

    python -m tests.torchrec.dmp_worker RANK WORLD INIT_FILE OUT_DIR

TorchRec's DLRM under DMP with its default wrapper (the dense part in DistributedDataParallel,
the tables sharded table-wise over the ranks, updated inside backward), each rank on its own
batches. Saved to ``OUT_DIR/rankN.pt``, per case, every parameter's value after the steps:

- ``plain``: DMP trained as TorchRec users train it (forward, loss, backward, SGD step), DDP
  averaging the dense gradients;
- ``placement``: the same under an engine placing the dense tower (a plan that changes no
  gradient: the engine averages them instead of DDP);
- ``cut``: the same under a blocking cut of the dense tower;
- ``cut_reference``: that cut on DMP without its wrapper, the gradients averaged by hand;
- ``ddp_restored``: whether the wrapper was its own again once the engine closed.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from erase_tune import Cut, EraseEngine, ErasePlan, Placement
from tests.torchrec.models import batch, dlrm, dmp, logits_loss, sgd
from tests.torchrec.test_models import flat_head

DENSE = "_dmp_wrapped_module.module.dense_arch"
PLANS = {
    "placement": ErasePlan(placements=(Placement(module=DENSE, stream=1),), num_streams=1),
    "cut": ErasePlan(cuts=(Cut(module=DENSE),), dispatch="blocking"),
}
STEPS = 3


def _batches(rank: int) -> list:
    return [batch(size=8, seed=100 * rank + s) for s in range(STEPS)]


def _values(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results: dict[str, object] = {}
    model = dmp(dlrm(device="meta"), wrap_dense=True)
    results["init"] = _values(model)
    opt = sgd([p for n, p in model.named_parameters() if "embedding_bags" not in n])
    for dense, kjt, labels in _batches(rank):
        logits_loss(model(dense, kjt), labels).backward()
        opt.step()
        opt.zero_grad()
    results["plain"] = _values(model)
    for name, plan in PLANS.items():
        model = dmp(dlrm(device="meta"), wrap_dense=True)
        dense, kjt, labels = _batches(rank)[0]
        torch.manual_seed(1)
        with EraseEngine(model, plan, loss_fn=logits_loss, optimizer=sgd, example=((dense, kjt), labels),
                         make_head=flat_head) as engine:
            results[f"{name}_heads"] = {k: {n: t.clone() for n, t in h.state_dict().items()}
                                        for k, h in engine.heads.items()}
            for dense, kjt, labels in _batches(rank):
                engine.step((dense, kjt), labels)
        results[name] = _values(model)
        results[f"{name}_restored"] = "forward" not in model._dmp_wrapped_module.__dict__
    results["cut_reference"] = _cut_by_hand(rank, world, results["cut_heads"])
    torch.save(results, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _cut_by_hand(rank: int, world: int, heads: dict) -> dict[str, torch.Tensor]:
    """The ``cut`` case's reference: DMP without its wrapper, the engine's forward_backward under
    the same cut (named as it is there) from the same heads, then every dense and head gradient
    summed over the ranks and divided by their number by hand, then the SGD step."""
    model = dmp(dlrm(device="meta"), wrap_dense=False)
    plan = ErasePlan(cuts=(Cut(module="_dmp_wrapped_module.dense_arch"),), dispatch="blocking")
    dense, kjt, labels = _batches(rank)[0]
    torch.manual_seed(1)
    with EraseEngine(model, plan, loss_fn=logits_loss, optimizer=sgd, example=((dense, kjt), labels),
                     make_head=flat_head) as engine:
        for (_, head), state in zip(engine.heads.items(), heads.values()):
            head.load_state_dict(state)
        averaged = [p for n, p in model.named_parameters() if "embedding_bags" not in n]
        averaged += [p for head in engine.heads.values() for p in head.parameters()]
        for dense, kjt, labels in _batches(rank):
            engine.optimizer.zero_grad()
            engine.forward_backward((dense, kjt), labels)
            for p in averaged:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
            engine.optimizer.step()
    return _values(model)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
