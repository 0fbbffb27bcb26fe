"""TorchRec models and batches shared by tests/torchrec: TorchRec's own DLRM and DLRM_DCN, an
EBC-based model of our own, KJT batches, and DistributedModelParallel on one gloo rank.

Import this only after ``pytest.importorskip("torchrec")``: where TorchRec is absent (the
GPU machine) the tests skip.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain

DENSE = 4
DIM = 8
ROWS = 50
FEATURES = ("f0", "f1", "f2")


def tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f])
            for i, f in enumerate(FEATURES)]


def dlrm(kind: str = "dlrm", *, device: str = "cpu", seed: int = 0) -> nn.Module:
    """TorchRec's own ``DLRM`` or ``DLRM_DCN``, seeded (``device="meta"`` for sharding by DMP)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ebc = EmbeddingBagCollection(tables=tables(), device=torch.device(device))
        common = dict(embedding_bag_collection=ebc, dense_in_features=DENSE, dense_arch_layer_sizes=[16, DIM],
                      over_arch_layer_sizes=[16, 1], dense_device=torch.device("cpu"))
        if kind == "dcn":
            return DLRM_DCN(**common, dcn_num_layers=2, dcn_low_rank_dim=4)
        return DLRM(**common)


class SparseTower(nn.Module):
    """Pools the id lists of every feature (an EBC) and flattens its KeyedTensor: (B, F·D)."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables())

    def forward(self, features: KeyedJaggedTensor) -> Tensor:
        # The EBC pools in float32 whatever its tables hold: follow the tables (a float64 check).
        return self.ebc(features).values().to(self.ebc.embedding_bags["t0"].weight.dtype)


class TwoTower(nn.Module):
    """Our own EBC-based click model: a dense MLP and a sparse tower, joined by an MLP that
    ends in a sigmoid. ``forward(dense, features) -> (B,)`` probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Sequential(nn.Linear(DENSE, 16), nn.ReLU(), nn.Linear(16, DIM), nn.ReLU())
        self.sparse = SparseTower()
        self.top = nn.Sequential(nn.Linear(DIM + DIM * len(FEATURES), 16), nn.ReLU(), nn.Linear(16, 1), nn.Sigmoid())

    def forward(self, dense: Tensor, features: KeyedJaggedTensor) -> Tensor:
        return self.top(torch.cat([self.dense(dense), self.sparse(features)], dim=1)).squeeze(-1)


def two_tower(seed: int = 0) -> TwoTower:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TwoTower()


def batch(size: int = 8, seed: int = 0) -> tuple[Tensor, KeyedJaggedTensor, Tensor]:
    """(dense, KJT of 0..3 ids per feature and example, 0/1 labels)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FEATURES) * size,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(FEATURES), values=values, lengths=lengths)
    dense = torch.randn(size, DENSE, generator=g)
    labels = torch.randint(0, 2, (size,), generator=g).float()
    return dense, kjt, labels


def train_batch(size: int = 8, seed: int = 0) -> Batch:
    """The same batch as TorchRec's ``Batch`` (what ``DLRMTrain`` and the train pipelines take)."""
    dense, kjt, labels = batch(size, seed)
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def logits_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """DLRM outputs logits (B, 1); the loss DLRMTrain uses, on the squeezed logits."""
    return nn.functional.binary_cross_entropy_with_logits(logits.squeeze(-1), labels)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def reference_grads(model: nn.Module, inputs: tuple, target: Tensor, plan, heads, loss_fn) -> nn.Module:
    """A copy of ``model`` whose gradients are one ordinary backward of the ERASE objective:
    hooks detach each cut's inputs (positional and keyword; a KJT has nothing to detach) and
    output, and add its head's weighted loss."""
    ref = copy.deepcopy(model)
    aux: list[Tensor] = []
    detach = (lambda x: x.detach() if isinstance(x, Tensor) else x)
    for cut in plan.cuts:
        module = ref.get_submodule(cut.module)
        module.register_forward_pre_hook(
            lambda m, args, kwargs: (tuple(map(detach, args)), {k: detach(v) for k, v in kwargs.items()}),
            with_kwargs=True)
        module.register_forward_hook(
            lambda m, args, out, cut=cut: aux.append(cut.aux_weight * loss_fn(heads[cut.module](out), target))
            or out.detach())
    (loss_fn(ref(*inputs), target) + sum(aux)).backward()
    return ref


# -- DistributedModelParallel on one gloo rank ---------------------------------------------------------


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo default process group, torn down after (TorchRec's DMP needs one)."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dmp(model: nn.Module, *, wrap_dense: bool, lr: float = 0.1) -> nn.Module:
    """``model`` (built on the meta device) under DistributedModelParallel: every table
    table-wise on the ranks of the default process group with the fused kernel (SGD applied
    inside backward). With
    ``wrap_dense`` DMP wraps the rest in its DistributedDataParallel (its default); without,
    a ``data_parallel_wrapper`` that wraps nothing."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DataParallelWrapper
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    class NoWrap(DataParallelWrapper):
        def wrap(self, dmp, env, device) -> None:  # dense parameters stay unwrapped
            pass

    constraints = {f"t{i}": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
                   for i in range(len(FEATURES))}
    sharder = EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": lr})
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder],
                                        **({} if wrap_dense else {"data_parallel_wrapper": NoWrap()}))


def table_weights(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every embedding table's weights, by parameter name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if "embedding_bags" in n}


__all__ = ["DLRMTrain", "batch", "dlrm", "dmp", "one_rank_group", "train_batch", "two_tower"]
