"""Gradient averaging across a process group for :class:`EraseEngine` (data parallel ERASE).

Every rank runs the same plan on its own shard of the global batch; after a step each
parameter's gradient is the average of the ranks' gradients, reduced exactly once. Two
schedules, selected by the plan's ``find_unused_parameters`` (docs/design.md, "Data parallel"):

- **on**: nothing is reduced early; after the main backward, all gradients (model and aux
  heads, in :meth:`EraseEngine.parameters` order) are all-reduced together.
- **off**: each cut's own parameters (those registered only under its modules, and its aux
  head's) are all-reduced asynchronously as soon as that cut's local backward is done, on the
  cut's stream, so the communication overlaps the rest of the forward; everything else is
  all-reduced after the main backward.

Collective order: every rank must issue the same collectives in the same order, or sums mix
different tensors (same sizes) or hang (different sizes). A cut's reduction is issued only by
the training thread, and only in plan order: cut ``i`` waits until cuts ``0..i-1`` have been
issued, however the worker threads' backwards happen to finish. Then the rest, once.

A parameter with no gradient on a rank contributes zeros (its gradient becomes a zero tensor
before the reduction), so every rank reduces the same tensors. Sparse gradients are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from erase_tune.errors import EraseTuneError, PlanError, shown
from erase_tune.runtime import device as dev

__all__ = ["GradReducer", "broadcast_from_rank0", "refuse_sparse", "plan_reducer", "early_reducer", "refuse_nested_ddp",
           "refuse_sharded", "data_parallel", "NestedDDP"]


def _buckets(tensors: Sequence[Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), each group in the given order."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def broadcast_from_rank0(tensors: Sequence[Tensor], group: Any) -> None:
    """Overwrite ``tensors`` with rank 0's values (what DDP does to a model at construction)."""
    src = dist.get_global_rank(group, 0)
    seen: set[int] = set()
    unique = [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]  # type: ignore[func-returns-value]
    with torch.no_grad():
        for idx in _buckets(unique):
            part = [unique[i].detach() for i in idx]
            flat = _flatten_dense_tensors(part)
            dist.broadcast(flat, src=src, group=group)
            for t, v in zip(part, _unflatten_dense_tensors(flat, part)):
                t.copy_(v)


def refuse_sparse(model: nn.Module) -> None:
    """Raise :class:`PlanError` if ``model`` has an embedding with sparse gradients."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse:
            raise PlanError(
                f"{type(m).__name__} {shown(name)} has sparse=True: sparse gradients are not reduced across a "
                "process group by EraseEngine; use sparse=False (dense gradients) for data-parallel training"
            )


class _Issued:
    """One all-reduce in flight: a flat buffer of some parameters' gradients."""

    def __init__(self, params: list[nn.Parameter], flat: Tensor, work: Any, stream: Any) -> None:
        self.params, self.flat, self.work, self.stream = params, flat, work, stream


class GradReducer:
    """Averages a step's gradients across ``group``: per-cut groups early, the rest at the end.

    ``cut_params[i]`` are the parameters reduced right after cut ``i``'s backward (empty lists
    for all cuts when the plan has ``find_unused_parameters``); ``rest`` are reduced after the
    main backward. ``names`` maps ``id(param)`` to a name for messages.
    """

    def __init__(self, group: Any, cut_names: Sequence[str], cut_params: Sequence[Sequence[nn.Parameter]],
                 rest: Sequence[nn.Parameter], names: dict[int, str], device: torch.device) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.cut_names = list(cut_names)
        self.cut_params = [list(ps) for ps in cut_params]
        self.rest = list(rest)
        self.names = names
        self.device = device
        self.filled: set[int] = set()
        """Parameters whose gradient was ``None`` on this rank at a reduction (zeros were sent)."""
        self.adopted: NestedDDP | None = None
        """The DDP wrappers inside the model whose averaging this reducer does, if any."""
        self.begin()

    def close(self) -> None:
        """Give the adopted DDP wrappers their own gradient synchronisation back."""
        if self.adopted is not None:
            self.adopted.close()
            self.adopted = None

    # -- one step ---------------------------------------------------------------------------------

    def begin(self) -> None:
        n = len(self.cut_names)
        self._launched: list[tuple[Any, Future | None] | None] = [None] * n  # (stream, future)
        self._next = 0
        self._issued: list[_Issued] = []
        self._early: list[tuple[nn.Parameter, Tensor, int]] = []  # (param, grad, version) when issued

    def launched(self, index: int, stream: Any, future: Future | None = None) -> None:
        """Cut ``index``'s local backward was launched (``future``: by a worker thread)."""
        if self._launched[index] is not None or index < self._next:
            raise PlanError(
                f"cut {shown(self.cut_names[index])} runs more than once in one forward: under a process group with "
                "find_unused_parameters: false its gradients are reduced after its first call; set "
                "find_unused_parameters: true"
            )
        self._launched[index] = (stream, future)
        self.poll()

    def poll(self) -> None:
        """Issue, in plan order, the reductions of the cuts whose backward is done (training thread only)."""
        while self._next < len(self._launched):
            entry = self._launched[self._next]
            if entry is None or (entry[1] is not None and not entry[1].done()):
                return
            self._issue_cut(self._next)

    def finish(self) -> None:
        """After the main backward, side streams joined: reduce the rest, wait, write averages back."""
        while self._next < len(self._launched):  # deferred cuts, and any not done yet, still in plan order
            entry = self._launched[self._next]
            if entry is not None and entry[1] is not None:
                entry[1].result()
            self._issue_cut(self._next, on_current=True)
        self._check_early()
        self._issue(self.rest, None)
        self._complete()

    def reduce_all(self) -> None:
        """Reduce every gradient now, cuts in plan order then the rest (after a graph replay)."""
        self.begin()
        self.finish()

    # -- internals ----------------------------------------------------------------------------------

    def _issue_cut(self, index: int, on_current: bool = False) -> None:
        entry = self._launched[index]
        stream = None if on_current or entry is None else entry[0]
        params = self.cut_params[index]
        self._issue(params, stream)
        self._early.extend((p, p.grad, p.grad._version) for p in params)  # type: ignore[union-attr]
        self._next = index + 1

    def _grad(self, p: nn.Parameter) -> Tensor:
        if p.grad is None:
            self.filled.add(id(p))
            p.grad = torch.zeros_like(p)
        elif p.grad.is_sparse:
            raise EraseTuneError(f"parameter {self.names.get(id(p), '?')} has a sparse gradient; EraseEngine does not "
                                 "reduce sparse gradients across a process group (use dense gradients)")
        return p.grad

    def _issue(self, params: list[nn.Parameter], stream: Any) -> None:
        if not params:
            return
        with dev.use_stream(stream):
            grads = [self._grad(p) for p in params]
            for idx in _buckets(grads):
                flat = _flatten_dense_tensors([grads[i] for i in idx])
                work = dist.all_reduce(flat, group=self.group, async_op=True)
                self._issued.append(_Issued([params[i] for i in idx], flat, work, stream))

    def _check_early(self) -> None:
        """A cut parameter whose gradient changed after its reduction was issued would be half reduced."""
        for p, grad, version in self._early:
            if p.grad is not grad or p.grad._version != version:
                raise PlanError(
                    f"parameter {self.names.get(id(p), '?')} got a gradient after its cut's reduction was issued "
                    "(it is used outside the cut); set find_unused_parameters: true to reduce everything at the end"
                )

    def _complete(self) -> None:
        here = dev.current_stream(self.device)
        issued, self._issued, self._early = self._issued, [], []
        for item in issued:
            item.work.wait()  # on CUDA: the current stream waits for the collective
            if here is not None:
                item.flat.record_stream(here)  # made on another stream, read here
            item.flat.div_(self.world)
            grads = [p.grad for p in item.params]
            for g, v in zip(grads, _unflatten_dense_tensors(item.flat, grads)):
                g.copy_(v)  # type: ignore[union-attr]

def data_parallel(group: Any, plan: Any, cut_runners: Sequence[Any], model: nn.Module, heads: nn.Module,
                  named: dict[str, nn.Parameter], device: torch.device) -> GradReducer | None:
    """An engine's gradient averaging. With ``group`` (``process_group=``): every parameter of
    the model and the heads, after rank 0's values are broadcast. Without, for a plan with pieces
    on a model holding DDP wrappers (DistributedModelParallel wraps its dense part so): those
    wrappers stand down (their forward is their module's, until the engine closes) and the engine
    averages what they would have, their modules' gradients and the aux heads', over their process
    group, in its own order around the early backward passes. Else None (one process)."""
    if group is not None:
        refuse_sparse(model)
        broadcast_from_rank0([*model.parameters(), *model.buffers(), *heads.parameters(), *heads.buffers()], group)
        return plan_reducer(group, plan, cut_runners, model, heads, named, device)
    wrappers = [(n, m) for n, m in model.named_modules() if n and isinstance(m, nn.parallel.DistributedDataParallel)]
    if not plan.targets or not wrappers:
        return None
    adopted = NestedDDP(wrappers)
    try:
        broadcast_from_rank0([*heads.parameters(), *heads.buffers()], adopted.group)
        reducer = plan_reducer(adopted.group, plan, cut_runners, model, heads, named, device, only=adopted.params)
    except BaseException:
        adopted.close()
        raise
    reducer.adopted = adopted
    return reducer


class NestedDDP:
    """DDP wrappers inside a model, standing down while an engine averages for them."""

    def __init__(self, wrappers: Sequence[tuple[str, nn.parallel.DistributedDataParallel]]) -> None:
        groups = {id(w.process_group) for _, w in wrappers}
        if len(groups) > 1:
            raise EraseTuneError(f"modules {', '.join(shown(n) for n, _ in wrappers[:3])} are wrapped in "
                                 "DistributedDataParallel over different process groups; EraseEngine averages "
                                 "one model's gradients over one group")
        self.group = wrappers[0][1].process_group
        # What each wrapper reduces: not the parameters it was told to ignore (DMP's sharded
        # tables, which differ from rank to rank and are updated by their own kernels).
        self.params = {id(p) for _, w in wrappers for n, p in w.module.named_parameters()
                       if n not in getattr(w, "parameters_to_ignore", ())}
        self._wrappers = [w for _, w in wrappers]
        for w in self._wrappers:
            # Its forward is its module's: no reducer is prepared, no static-graph all-reduce is
            # queued (DMP's wrapper has a static graph, whose first backward would all-reduce).
            # Buffers are not broadcast from rank 0 meanwhile (DMP's wrapper does not either).
            w.__dict__["forward"] = w.module.__call__  # (a Module set as an attribute would be registered)

    def close(self) -> None:
        for w in self._wrappers:
            w.__dict__.pop("forward", None)


def plan_reducer(group: Any, plan: Any, cut_runners: Sequence[Any], model: nn.Module, heads: nn.Module,
                 named: dict[str, nn.Parameter], device: torch.device, only: set[int] | None = None) -> GradReducer:
    """The reducer of an engine's plan: per cut, the parameters registered only under its
    modules, and its head's (reduced early unless ``find_unused_parameters``); the rest.
    ``only``: the model's parameters to average (ids), the heads' always (None: all)."""
    names = {id(p): n for n, p in named.items()}
    heads_ids = {id(p) for p in heads.parameters()}
    trainable = [p for p in dict.fromkeys([*model.parameters(), *heads.parameters()])
                 if p.requires_grad and (only is None or id(p) in only or id(p) in heads_ids)]
    kept = {id(p) for p in trainable}
    owners: dict[int, list[str]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(mname)
    cut_params: list[list[nn.Parameter]] = []
    if not plan.find_unused_parameters:
        for runner in cut_runners:
            members = runner.cut.members
            own = [p for m in runner.modules for p in m.parameters() if id(p) in kept]
            inside = [p for p in own
                      if all(any(o == m or o.startswith(m + ".") for m in members) for o in owners[id(p)])]
            head = [p for p in runner.head.parameters() if id(p) in kept]
            cut_params.append(list(dict.fromkeys([*inside, *head])))
    early = {id(p) for ps in cut_params for p in ps}
    rest = [p for p in trainable if id(p) not in early]
    return GradReducer(group, [c.name for c in plan.cuts] if cut_params else [], cut_params, rest, names, device)


def early_reducer(reducer: GradReducer | None, plan: Any, cut_runners: Sequence[Any],
                  graph_warmup: int) -> GradReducer | None:
    """The reducer that averages each cut's gradients right after its backward in this step:
    none with ``find_unused_parameters`` (all at the end), and none in a step that captures a
    per-cut graph, which must not run beside collectives in flight (every rank captures at
    the same step)."""
    if reducer is None or plan.find_unused_parameters:
        return None
    capture_now = any(r.graphed and r.graph is None and r.calls >= graph_warmup for r in cut_runners)
    return None if capture_now else reducer


def refuse_nested_ddp(model: nn.Module) -> None:
    """With ``process_group=`` the engine averages every gradient itself; DDP inside the model
    would average its part a second time: one line naming the wrapped module."""
    for name, m in model.named_modules():
        if name and isinstance(m, nn.parallel.DistributedDataParallel):
            raise EraseTuneError(
                f"module {shown(name)} is wrapped in DistributedDataParallel inside the model (as "
                "DistributedModelParallel does by default) and process_group= is given too: leave process_group= "
                "out (the engine then averages the wrapped module's gradients over its own group)"
            )


def refuse_sharded(model: nn.Module) -> None:
    """Tables sharded by TorchRec live on their own ranks: averaging them (or broadcasting rank
    0's) across a process group would mix up different tables. Found by class, so that the
    engine needs no TorchRec import."""
    for name, m in model.named_modules():
        if any(c.__name__ == "ShardedModule" and c.__module__.startswith("torchrec.") for c in type(m).__mro__):
            raise EraseTuneError(
                f"module {shown(name)} is sharded by TorchRec ({type(m).__name__}): its tables differ from rank to rank, "
                "so the engine's process_group= averaging cannot take it; train a DistributedModelParallel model "
                "under a plan on one rank, without process_group="
            )
