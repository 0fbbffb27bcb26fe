"""The ERASE engine: applies an :class:`ErasePlan` to any ``nn.Module`` and trains it.

Per cut, the engine (without editing the model's code) detaches the piece's input and
output, attaches an aux head, and computes the local loss ``λ·ℓ(head(out), y)`` right after
the piece's forward, on the piece's stream. Its backward is then launched at once — from the
main thread (``blocking``) or a worker thread (``threaded``) — so it overlaps the forward
work that follows on the main stream; or, for ``deferred``, it joins the main loss in one
backward at the end (the "detach only" twin). A placement runs its piece's forward on a side
stream as it is (no detach, no head), so its forward overlaps other work and autograd runs
its backward on the same stream. A graphed piece is captured (forward and backward) as CUDA
graphs after a few eager calls and replayed from then on, not detached. Outputs of
side-stream work are joined lazily, where they are first used
(:mod:`erase_tune.runtime.join`), so sibling pieces run side by side. After the main backward
every side stream is joined back to the current stream before the optimizer runs. The
runners that do each element's work live in :mod:`erase_tune.runtime.pieces`; the engine's
own host work per step is a fixed amount, whatever the number of torch calls in the model.

Exactness: gradients inside each cut and inside the remainder equal those of the reference
objective ``L_main + Σ λ_i ℓ_i`` with stop-gradients at the cut boundaries; placements change
no gradient.

Before training, one probe forward (:mod:`erase_tune.runtime.probe`) checks that the plan
fits the model — every target is called, runs are chains, cuts return one tensor and leave
the main loss a gradient path and every parameter a gradient — and sizes the aux heads. A
plan with no cuts and no placements skips it: it trains exactly like a plain loop.

CUDA graphs: a cut flagged ``graph`` has its forward + local loss + backward captured as its
own graph (own memory pool) after a few eager warm-up calls; a plan with
``whole_step_graph`` captures the whole step (forward, early backwards on their streams, main
backward, optimizer with ``capturable=True``) and replays it
(:mod:`erase_tune.runtime.capture`). Graph-owned gradients are overwritten on every replay,
so the engine never sets them to ``None``.

Data parallel: with ``process_group=``, gradients are averaged across the group once per step
(:mod:`erase_tune.runtime.reduce`): per cut right after its local backward, in plan order, or
all at the end, as the plan's ``find_unused_parameters`` says; under a whole-step graph, after
the replay, with the optimizer run eagerly. docs/design.md, "Data parallel".

How a piece is applied: the first module of a cut, placement or graphed piece gets an instance-level
``forward`` that runs the whole piece (for a run ``blocks.2:5``: blocks 2, 3, 4 chained);
later blocks of a run become identities while the engine is attached. ``close()`` restores
the model.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from erase_tune.errors import EraseTuneError, PlanError, one_line, shown
from erase_tune.runtime import device as dev
from erase_tune.runtime.capture import StepGraph
from erase_tune.runtime.join import LazyJoin
from erase_tune.runtime.pieces import CutRunner, GraphedRunner, Passthrough, PlacedRunner, StepState
from erase_tune.runtime.plan import ErasePlan, Placement
from erase_tune.runtime.probe import ProbeResult, probe
from erase_tune.runtime.reduce import GradReducer, broadcast_from_rank0, refuse_sparse

__all__ = ["EraseEngine", "LinearHead"]

HeadFactory = Callable[[str, Tensor, Tensor], nn.Module]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

_ACTIVATIONS: Mapping[str, Callable[[Tensor], Tensor] | None] = {
    "none": None,
    "sigmoid": torch.sigmoid,
    "softmax": functools.partial(torch.softmax, dim=-1),
    "log_softmax": functools.partial(torch.log_softmax, dim=-1),
}
_NAMES_SHOWN = 5


class LinearHead(nn.Module):
    """Default aux head: a linear map from the cut's output features to the model's output.

    (…, d) → (…, k) where k is the model output's last dim; a 1-D model output (B,) is
    matched by mapping to one feature and squeezing it. ``activation`` repeats the one the
    model's output ends in (``sigmoid``, ``softmax`` or ``log_softmax`` over the last dim),
    so the head produces what ``loss_fn`` takes: probabilities for BCE, logits otherwise.
    """

    def __init__(self, in_features: int, out_features: int, squeeze: bool, activation: str = "none") -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(_ACTIVATIONS)}, got {activation!r}")
        self.proj = nn.Linear(in_features, out_features)
        self.squeeze = squeeze
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        y = self.proj(x)
        if self.squeeze:
            y = y.squeeze(-1)
        act = _ACTIVATIONS[self.activation]
        return act(y) if act is not None else y


def _default_head(name: str, cut_out: Tensor, model_out: Tensor, *, activation: str = "none") -> nn.Module:
    squeeze = model_out.dim() == cut_out.dim() - 1
    out_features = 1 if squeeze else model_out.shape[-1]
    return LinearHead(cut_out.shape[-1], out_features, squeeze, activation)


class EraseEngine:
    """Train ``model`` under ``plan``: ``engine.step(inputs, target) -> loss``.

    Args:
        model: any ``nn.Module``, already on its device; its code is not edited.
        plan: where to cut and place, and how to run; checked against ``model`` (names, then
            one probe forward: see :mod:`erase_tune.runtime.probe`). A plan that does not fit
            raises a one-line :class:`PlanError`.
        loss_fn: mean-reduced ``loss_fn(output, target)``, for the main and every local loss.
        optimizer: factory over ``engine.parameters()`` (model and aux heads); Adam by default.
            Parameters with sparse gradients (``nn.Embedding(sparse=True)``) need an optimizer
            that takes them (SGD, Adagrad, SparseAdam); a dense-only one is refused at the
            first step with an error naming those parameters.
        example: ``(inputs, target)`` of one batch, used once to probe the plan and size the
            aux heads (needed when the plan has cuts or placements).
        make_head: optional ``(cut_name, cut_output, model_output) -> nn.Module``, the aux head
            of a cut. Its output must have the model output's shape and be what ``loss_fn``
            takes. The default is a :class:`LinearHead` that ends in the activation the model's
            output ends in (sigmoid, softmax or log-softmax over the last dim; none for logits).
            For anything else (a loss over a structured output, a model that ends in tanh, a
            head that needs more than one layer) pass ``make_head``; the engine checks once,
            on the example batch, that ``loss_fn(head(cut_output), target)`` is finite.
        graph_warmup: eager steps (or per-cut calls) before a CUDA graph is captured.
        process_group: data-parallel training: gradients (model and aux heads) are averaged
            across this ``torch.distributed`` group, once per step, on the schedule the plan's
            ``find_unused_parameters`` selects (docs/design.md, "Data parallel"). At
            construction the model's parameters and buffers (and the heads') are broadcast
            from the group's rank 0, as DDP does; every rank must build its engine with the
            same model, plan and example shapes, and feed batches of equal size (the average
            of per-rank mean losses is then the mean over the global batch). ``None`` (the
            default) reduces nothing, even when ``torch.distributed`` is initialised: the
            engine stays single-process. Pass the bare module, never a
            ``DistributedDataParallel`` wrapper (refused). Sparse gradients are refused.
    """

    # -- what it trains, and how (set at construction, read-only after) -----------------------------
    model: nn.Module
    plan: ErasePlan
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    optimizer: torch.optim.Optimizer
    heads: Mapping[str, nn.Module]
    """Aux head of each cut, by cut name."""
    graph_warmup: int
    process_group: Any

    # -- where it runs ----------------------------------------------------------------------------
    device: torch.device
    cuda: bool
    capture_stream: Any
    """The stream CUDA graphs are captured on (None on the CPU)."""
    graph_owned: set[int]
    """ids of parameters whose gradients live in a CUDA graph's pool (never set to None)."""

    # -- the step in progress ---------------------------------------------------------------------
    state: StepState | None
    """The forward in progress (None between steps): what the runners accumulate."""
    capture_retries: int
    """Whole-step captures that failed once and succeeded on the retry."""

    def __init__(
        self,
        model: nn.Module,
        plan: ErasePlan,
        *,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        optimizer: OptimizerFactory | None = None,
        example: tuple[Any, Tensor] | None = None,
        make_head: HeadFactory | None = None,
        graph_warmup: int = 3,
        process_group: Any = None,
    ) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise EraseTuneError(
                "EraseEngine takes the bare module, not DistributedDataParallel: pass model.module and "
                "process_group=...; the engine averages gradients itself (DDP's reducer does not expect the "
                "early backward passes of detached pieces)"
            )
        plan.check_model(model)
        self.model, self.plan, self.loss_fn, self.graph_warmup = model, plan, loss_fn, graph_warmup
        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self.cuda = dev.is_cuda(self.device)
        self.graph_owned = set()
        self.state = None
        self.capture_retries = 0
        self._steps = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []  # threaded dispatch: backward passes in flight

        self._probe: ProbeResult | None = None
        heads: dict[str, nn.Module] = {}
        if plan.targets:
            result, target = self._check_plan(example)
            heads = self._build_heads(result, target, make_head)
            # Kept for the first step's check; the example's tensors are not needed any more.
            self._probe = dataclasses.replace(result, model_output=None, outputs={})
        self._head_modules = nn.ModuleList(heads.values())
        self.heads = MappingProxyType(heads)
        self._params = list(dict.fromkeys([*model.parameters(), *self._head_modules.parameters()]))

        self.process_group = process_group
        self._reducer: GradReducer | None = None
        self._active: GradReducer | None = None  # the reducer of the step in progress
        if process_group is not None:
            refuse_sparse(model)
            broadcast_from_rank0([*model.parameters(), *model.buffers(), *self._head_modules.parameters(),
                                  *self._head_modules.buffers()], process_group)
        self._streams = [dev.new_stream(self.device) for _ in range(plan.num_streams)]
        self.capture_stream = dev.new_stream(self.device)
        side_work = any(t.stream for t in plan.targets)
        self._join = LazyJoin(self.device) if self.cuda and side_work else None
        self.optimizer = (optimizer or functools.partial(torch.optim.Adam, lr=1e-3))(self.parameters())
        whole = plan.whole_step_graph and self.cuda
        if whole and process_group is None:  # else: eager optimizer after the replay
            for group in self.optimizer.param_groups:
                if "capturable" in group:
                    group["capturable"] = True
        self._graph = StepGraph(self) if whole else None
        self._patched: list[tuple[nn.Module, Any]] = []  # (module, the instance forward it had, if any)
        self._cut_runners = self._patch_plan(heads, whole)
        if process_group is not None:
            self._reducer = self._make_reducer(process_group)

    # -- public API ------------------------------------------------------------------------------

    def parameters(self) -> Iterator[nn.Parameter]:
        """Model parameters, then aux-head parameters (in cut order)."""
        yield from self.model.parameters()
        yield from self._head_modules.parameters()

    def step(self, inputs: Tensor | Sequence[Any], target: Tensor) -> Tensor:
        """One training step (zero grads, forward, early + main backward, optimizer). Returns
        the detached total loss ``L_main + Σ λ_i ℓ_i`` as a device tensor (no CPU sync)."""
        inputs = _as_tuple(inputs)
        with torch.enable_grad():
            if self._graph is not None:
                return self._graph.step(inputs, target)
            return self.eager_step(inputs, target)

    def eager_step(self, inputs: tuple, target: Tensor, dispatch: str | None = None) -> Tensor:
        """One step without a whole-step graph (also the graph's warm-up steps)."""
        self.zero_grad()
        loss = self._forward_backward(inputs, target, dispatch or self.plan.dispatch, self._reducer)
        self._check_first_step()
        self.optimizer_step()
        self._steps += 1
        return loss

    def forward_backward(self, inputs: Tensor | Sequence[Any], target: Tensor) -> Tensor:
        """Compute gradients for one batch (no optimizer step, no zeroing); eager path. Under a
        process group the gradients are averaged across it before this returns (every call:
        accumulating over calls sums the averages)."""
        return self._forward_backward(_as_tuple(inputs), target, self.plan.dispatch, self._reducer)

    def close(self) -> None:
        """Restore the model's own forwards and stop the worker thread."""
        for m, own in reversed(self._patched):
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = own
        self._patched = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> EraseEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the runners use (pieces.Host) --------------------------------------------------------

    def side_stream(self, index: int) -> Any:
        return self._streams[index - 1] if index > 0 else None

    def drain_workers(self) -> None:
        """Wait for the worker thread's backward passes to be queued (re-raising their errors)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()  # re-raises a worker's exception in the training thread

    def launch_backward(self, aux: Tensor, stream: Any, index: int) -> None:
        mode = self.state.dispatch if self.state is not None else self.plan.dispatch
        if mode == "deferred":
            self.state.deferred.append(aux)  # type: ignore[union-attr]  # its reduction waits for the main backward
        elif mode == "threaded":
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="erase-bwd", initializer=self._init_worker)
            future = self._pool.submit(_backward_on, aux, stream)
            self._pending.append(future)
            self.cut_backward_done(index, stream, future)
        else:
            _backward_on(aux, stream)
            self.cut_backward_done(index, stream, None)

    def cut_backward_done(self, index: int, stream: Any, future: Future | None) -> None:
        """Cut ``index``'s local backward is queued (or, with ``future``, will be): under a process
        group with early reduction, issue the reductions that are due, in plan order."""
        if self._active is not None and not self.plan.find_unused_parameters:
            self._active.launched(index, stream, future)

    # -- what the step graph uses (capture.StepGraph) ----------------------------------------------

    def zero_grad(self) -> None:
        owned = self.graph_owned
        for p in self._params:
            if id(p) not in owned:
                p.grad = None

    def optimizer_step(self) -> None:
        try:
            self.optimizer.step()
        except RuntimeError as e:
            sparse = [n for n, p in self._named_parameters() if p.grad is not None and p.grad.is_sparse]
            if not sparse or "sparse" not in str(e).lower():
                raise
            names = ", ".join(sparse[:_NAMES_SHOWN]) + (", …" if len(sparse) > _NAMES_SHOWN else "")
            raise EraseTuneError(
                f"optimizer {type(self.optimizer).__name__} cannot take the sparse gradients of {names}: give them "
                "a sparse-capable optimizer (SparseAdam, SGD, Adagrad) in a separate param group or optimizer"
            ) from None

    def reduce_after_replay(self) -> None:
        """Under a process group, after a whole-step replay: average every gradient, then step."""
        if self._reducer is not None:
            self._reducer.reduce_all()
            self.optimizer_step()

    def captured_step(self, inputs: tuple, target: Tensor) -> Tensor:
        """The work a whole-step capture records: forward + backward (no collectives; a blocking
        or deferred launch), then the optimizer unless a process group reduces first."""
        dispatch = "deferred" if self.plan.dispatch == "deferred" else "blocking"
        loss = self._forward_backward(inputs, target, dispatch, None)
        if self._reducer is None:
            self.optimizer.step()
        return loss

    def abandon_step(self) -> None:
        """Forget a step that failed part way (a capture that did not complete)."""
        self.state, self._pending = None, []

    # -- the forward and backward ------------------------------------------------------------------

    def _forward_backward(self, inputs: tuple, target: Tensor, dispatch: str, reducer: GradReducer | None) -> Tensor:
        state = StepState(target=target, join=self._join, dispatch=dispatch)
        self.state = state
        if reducer is not None:
            reducer.begin()
            # A per-cut graph captured in this step must not run beside collectives in flight:
            # that step reduces everything at the end (every rank captures at the same step).
            capture_now = any(r.graphed and r.graph is None and r.calls >= self.graph_warmup for r in self._cut_runners)
            self._active = None if capture_now else reducer
        try:
            with torch.enable_grad():
                if state.join is not None:
                    with state.join:
                        out = self.model(*inputs)
                        main = self.loss_fn(out, target)
                        total = main + sum(state.deferred) if state.deferred else main
                    state.join.clear()
                else:
                    out = self.model(*inputs)
                    main = self.loss_fn(out, target)
                    total = main + sum(state.deferred) if state.deferred else main
                if self._active is not None:
                    self._active.poll()
                self._check_main_loss(main)
                total.backward()
            self._join_streams()
            if reducer is not None:
                reducer.finish()
        finally:
            self.state = None
            self._active = None
            if state.join is not None:
                state.join.clear()
        loss = main.detach()
        for aux in state.aux_values:
            loss = loss + aux
        return loss

    def _join_streams(self) -> None:
        # Kernels must be queued before wait_stream records its event: drain the workers first.
        self.drain_workers()
        if self._streams:
            main = dev.current_stream(self.device)
            for s in self._streams:
                dev.wait_stream(main, s)

    # -- checking the plan and building the heads -------------------------------------------------

    def _check_plan(self, example: tuple[Any, Tensor] | None) -> tuple[ProbeResult, Tensor]:
        if example is None:
            raise PlanError("EraseEngine needs example=(inputs, target) to check a plan with cuts, placements or "
                            "graphed pieces against the model and size its aux heads")
        inputs, target = example
        targets = [t.module for t in self.plan.targets]
        result = probe(self.model, _as_tuple(inputs), targets)
        result.check_plan(self.plan)
        return result, target

    def _build_heads(self, result: ProbeResult, target: Tensor, make_head: HeadFactory | None) -> dict[str, nn.Module]:
        factory = make_head or functools.partial(_default_head, activation=result.output_activation)
        heads: dict[str, nn.Module] = {}
        for cut in self.plan.cuts:
            out = result.outputs[cut.name]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(cut.name.encode()))  # same head init in every engine
                head = factory(cut.name, out, result.model_output).to(device=out.device, dtype=out.dtype)
            self._check_head(cut.name, head, out, result.model_output, target)
            heads[cut.name] = head
        return heads
    def _check_head(self, name: str, head: nn.Module, out: Tensor, model_out: Any, target: Tensor) -> None:
        fix = "pass make_head with a head for this cut"
        with torch.no_grad():
            try:
                pred = head(out)
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                raise PlanError(f"cut {shown(name)}: the aux head fails on the cut's output "
                                f"({_first_line(e)}); {fix}") from None
            shape = tuple(getattr(model_out, "shape", ()))
            if not isinstance(pred, Tensor) or tuple(pred.shape) != shape:
                got = tuple(pred.shape) if isinstance(pred, Tensor) else type(pred).__name__
                raise PlanError(f"cut {shown(name)}: aux head maps output {tuple(out.shape)} to {got}, "
                                f"but the model's output is {shape}; {fix}")
            try:
                loss = _loss_on_cpu(self.loss_fn, pred, target)
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                raise PlanError(f"cut {shown(name)}: loss_fn does not take the aux head's output "
                                f"({_first_line(e)}); {fix} whose output loss_fn takes") from None
            if not isinstance(loss, Tensor) or not bool(torch.isfinite(loss).all()):
                raise PlanError(f"cut {shown(name)}: loss_fn gives {shown(loss)} on the aux head's output for the "
                                f"example batch; {fix} whose output loss_fn takes (or fix the loss, if it is at fault)")

    # -- internals --------------------------------------------------------------------------------

    def _patch_plan(self, heads: Mapping[str, nn.Module], whole: bool) -> list[CutRunner]:
        """Patch each element's first module with its runner; under a whole-step graph a graphed
        piece is already inside the step's graph: on a side stream it is a placement."""
        modules = dict(self.model.named_modules())
        cut_runners = []
        for i, cut in enumerate(self.plan.cuts):
            graphed = cut.graph and dev.graphs_supported(self.device) and not self.plan.whole_step_graph
            runner = CutRunner(self, i, cut, [modules[m] for m in cut.members], heads[cut.name], graphed)
            cut_runners.append(runner)
            self._patch(runner)
        for placement in self.plan.placements:
            self._patch(PlacedRunner(self, placement, [modules[m] for m in placement.members]))
        for g in self.plan.graphs:
            members = [modules[m] for m in g.members]
            if not whole:
                self._patch(GraphedRunner(self, g, members))
            elif g.stream:
                self._patch(PlacedRunner(self, Placement(module=g.module, stream=g.stream), members))
        return cut_runners

    def _patch(self, runner: Any) -> None:
        first, *rest = runner.modules
        for m, fwd in ((first, runner), *((m, Passthrough(m)) for m in rest)):
            self._patched.append((m, m.__dict__.get("forward")))
            m.forward = fwd  # instance attribute shadows the class's forward

    def _check_main_loss(self, main: Tensor) -> None:
        if isinstance(main, Tensor) and main.requires_grad:
            return
        if self.plan.cuts:
            raise PlanError(f"the main loss has no gradient path under this plan: its cuts "
                            f"({', '.join(shown(c.module) for c in self.plan.cuts)}) detach every path "
                            "from the model's output to a trainable parameter")
        raise EraseTuneError("the loss does not require grad: no trainable parameter reaches the model's output")

    def _check_first_step(self) -> None:
        """After the first backward: every parameter the plain model trains has a gradient."""
        if self._steps or self._probe is None:
            return
        named = dict(self.model.named_parameters())
        filled = self._reducer.filled if self._reducer is not None else set()
        missing = [n for n in self._probe.trainable if named[n].grad is None or id(named[n]) in filled]
        if missing:
            raise PlanError(self._probe.starved_message(self.plan, missing))

    def _named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.model.named_parameters()
        for name, head in self.heads.items():
            yield from ((f"head[{name}].{n}", p) for n, p in head.named_parameters())
    def _make_reducer(self, group: Any) -> GradReducer:
        """Per cut, the parameters registered only under its modules, and its head's; the rest."""
        names = {id(p): n for n, p in self._named_parameters()}
        trainable = [p for p in dict.fromkeys(self.parameters()) if p.requires_grad]
        owners: dict[int, list[str]] = {}
        for mname, m in self.model.named_modules(remove_duplicate=False):
            for p in m._parameters.values():
                if p is not None:
                    owners.setdefault(id(p), []).append(mname)
        cut_params: list[list[nn.Parameter]] = []
        if not self.plan.find_unused_parameters:
            for runner in self._cut_runners:
                members = runner.cut.members
                own = [p for m in runner.modules for p in m.parameters() if p.requires_grad]
                inside = [p for p in own
                          if all(any(o == m or o.startswith(m + ".") for m in members) for o in owners[id(p)])]
                head = [p for p in runner.head.parameters() if p.requires_grad]
                cut_params.append(list(dict.fromkeys([*inside, *head])))
        early = {id(p) for ps in cut_params for p in ps}
        rest = [p for p in trainable if id(p) not in early]
        return GradReducer(group, [c.name for c in self.plan.cuts] if cut_params else [], cut_params, rest,
                           names, self.device)

    def _init_worker(self) -> None:
        if self.cuda:  # a worker thread does not inherit the current device
            torch.cuda.set_device(self.device)



def _backward_on(aux: Tensor, stream) -> None:
    # The gradient seed is created on the current stream: make it the cut's stream.
    with dev.use_stream(stream):
        aux.backward()


def _loss_on_cpu(loss_fn: Callable[[Tensor, Tensor], Tensor], pred: Tensor, target: Tensor) -> Any:
    """``loss_fn(pred, target)``, on CPU copies where the loss allows: a CUDA loss kernel given
    out-of-range input (BCE on logits) fails with a device-side assert that ends the process's
    CUDA context, while on the CPU it is an ordinary error."""
    if pred.device.type == "cpu":
        return loss_fn(pred, target)
    try:
        return loss_fn(pred.cpu(), target.cpu())
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        if "device" not in str(e):
            raise
    return loss_fn(pred, target)  # the loss holds device state of its own (a weight, a module)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return one_line(text[0] if text else type(e).__name__)[:200]


def _as_tuple(inputs: Any) -> tuple:
    if isinstance(inputs, Tensor):
        return (inputs,)
    return tuple(inputs)
