"""The ERASE engine: applies an :class:`ErasePlan` to any ``nn.Module`` and trains it.

Per cut, the engine (without editing the model's code) detaches the piece's input and
output, attaches an aux head, and computes the local loss ``λ·ℓ(head(out), y)`` right after
the piece's forward, on the piece's stream. Its backward is then launched at once — from the
main thread (``blocking``) or a worker thread (``threaded``) — so it overlaps the forward
work that follows on the main stream; or, for ``deferred``, it joins the main loss in one
backward at the end (the "detach only" twin). After the main backward every side stream
is joined back to the current stream before the optimizer runs.

Exactness: gradients inside each cut and inside the remainder equal those of the reference
objective ``L_main + Σ λ_i ℓ_i`` with stop-gradients at the cut boundaries.

CUDA graphs: a cut flagged ``graph`` has its forward + local loss + backward captured as its
own graph (own memory pool) after a few eager warm-up calls; a plan with
``whole_step_graph`` captures the whole step (forward, early backwards on their streams, main
backward, optimizer with ``capturable=True``) and replays it. Graph-owned gradients are
overwritten on every replay, so the engine never sets them to ``None``.

How a cut is applied: the first module of the cut gets an instance-level ``forward`` that
runs the whole cut (for a run ``blocks.2:5``: blocks 2, 3, 4 chained); later blocks of a run
become identities while the engine is attached. ``close()`` restores the model.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from erase_tune.errors import CaptureError, PlanError
from erase_tune.runtime import device as dev
from erase_tune.runtime.plan import Cut, ErasePlan

__all__ = ["EraseEngine", "LinearHead"]

HeadFactory = Callable[[str, Tensor, Tensor], nn.Module]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class LinearHead(nn.Module):
    """Default aux head: a linear map from the cut's output features to the model's output.

    (…, d) → (…, k) where k is the model output's last dim; a 1-D model output (B,) is
    matched by mapping to one feature and squeezing it.
    """

    def __init__(self, in_features: int, out_features: int, squeeze: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features)
        self.squeeze = squeeze

    def forward(self, x: Tensor) -> Tensor:
        y = self.proj(x)
        return y.squeeze(-1) if self.squeeze else y


def _default_head(name: str, cut_out: Tensor, model_out: Tensor) -> nn.Module:
    squeeze = model_out.dim() == cut_out.dim() - 1
    out_features = 1 if squeeze else model_out.shape[-1]
    return LinearHead(cut_out.shape[-1], out_features, squeeze)


def _tensors(tree: Any) -> list[Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]


def _detach(tree: Any) -> Any:
    return tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, tree)


class _CutRunner:
    """Runs one cut inside a step: detach, stream, local loss, early backward, graphs."""

    def __init__(self, engine: EraseEngine, index: int, cut: Cut, modules: Sequence[nn.Module], head: nn.Module):
        self.engine = engine
        self.index = index
        self.cut = cut
        self.modules = list(modules)
        self.head = head
        # Bound forwards captured before patching: the cut calls these directly.
        self.forwards = [m.forward for m in self.modules]
        self.graphed = cut.graph and dev.graphs_supported(engine.device) and not engine.plan.whole_step_graph
        self.params = [p for m in [*self.modules, head] for p in m.parameters() if p.requires_grad]
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: tuple[list[Tensor], Tensor, Any, Tensor] | None = None

    def chain(self, args: tuple, kwargs: dict) -> Any:
        out = self.forwards[0](*args, **kwargs)
        for fwd in self.forwards[1:]:
            out = fwd(out)
        return out

    def local_loss(self, out: Any, target: Tensor) -> Tensor:
        if not isinstance(out, Tensor):
            raise PlanError(
                f"cut {self.cut.name!r}: the module returns {type(out).__name__}, but a cut must return one tensor"
            )
        return self.cut.aux_weight * self.engine.loss_fn(self.head(out), target)

    def __deepcopy__(self, memo: dict) -> Any:
        return _unpatched_copy(self.modules[0], memo)

    # -- the patched forward -----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        eng = self.engine
        if not eng._in_step:  # evaluation or inference: the plain model
            return self.chain(args, kwargs)
        device = eng.device
        stream = eng._side_stream(self.cut.stream)
        main = dev.current_stream(device)
        args, kwargs = _detach(args), _detach(kwargs)
        target = eng._target
        dev.wait_stream(stream, main)
        dev.record_stream(iter([*_tensors((args, kwargs)), target]), stream, device)
        with dev.use_stream(stream):
            if self.graphed and self.calls >= eng.graph_warmup:
                out, aux = self._replay(args, kwargs, target)
                fwd_done = dev.record_event(stream)
            else:
                with torch.enable_grad():
                    out = self.chain(args, kwargs)
                    aux = self.local_loss(out, target)
                fwd_done = dev.record_event(stream)  # before the backward is queued behind it
                eng._launch_backward(aux, stream)
            self.calls += 1
        out = out.detach()
        dev.wait_event(main, fwd_done)
        dev.record_stream(iter([out]), main, device)
        eng._aux_values.append(aux.detach())
        return out

    # -- per-cut CUDA graph --------------------------------------------------------------------

    def _replay(self, args: tuple, kwargs: dict, target: Tensor) -> tuple[Tensor, Tensor]:
        if self.graph is None:
            self._capture(args, kwargs, target)
        static_in, static_target, static_out, static_aux = self.static  # type: ignore[misc]
        live = _tensors((args, kwargs))
        for s, x in zip(static_in, live):
            if s.shape != x.shape:
                raise CaptureError(
                    f"cut {self.cut.name!r}: captured with input shape {tuple(s.shape)}, got {tuple(x.shape)}; "
                    "per-cut CUDA graphs need static shapes"
                )
            s.copy_(x)
        static_target.copy_(target)
        self.graph.replay()  # type: ignore[union-attr]
        return static_out, static_aux

    def _capture(self, args: tuple, kwargs: dict, target: Tensor) -> None:
        eng = self.engine
        eng._drain_workers()  # no other thread may touch the device while we capture
        static_args, static_kwargs = tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, (args, kwargs))
        static_in = _tensors((static_args, static_kwargs))
        static_target = target.clone()
        for p in self.params:
            p.grad = None  # allocate the grads from the graph's pool: replays overwrite them
        graph = torch.cuda.CUDAGraph()
        cap = eng._capture_stream
        dev.wait_stream(cap, dev.current_stream(eng.device))
        try:
            with torch.cuda.graph(graph, stream=cap), torch.enable_grad():
                out = self.chain(static_args, static_kwargs)
                aux = self.local_loss(out, static_target)
                aux.backward()
        except (RuntimeError, torch.cuda.CudaError) as e:  # type: ignore[attr-defined]
            raise CaptureError(f"cut {self.cut.name!r}: CUDA graph capture failed: {str(e).splitlines()[0]}") from e
        dev.wait_stream(dev.current_stream(eng.device), cap)
        self.graph = graph
        self.static = (static_in, static_target, out.detach(), aux.detach())
        eng._graph_owned.update(id(p) for p in self.params)


class EraseEngine:
    """Train ``model`` under ``plan``: ``engine.step(inputs, target) -> loss``.

    Args:
        model: any ``nn.Module``, already on its device; its code is not edited.
        plan: where to cut and how to run; checked against ``model``.
        loss_fn: mean-reduced ``loss_fn(output, target)``, for the main and every local loss.
        optimizer: factory over ``engine.parameters()`` (model and aux heads); Adam by default.
        example: ``(inputs, target)`` of one batch, used once to size the aux heads.
        make_head: optional ``(cut_name, cut_output, model_output) -> nn.Module``.
        graph_warmup: eager steps (or per-cut calls) before a CUDA graph is captured.
    """

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
    ) -> None:
        plan.check_model(model)
        self.model = model
        self.plan = plan
        self.loss_fn = loss_fn
        self.graph_warmup = graph_warmup
        params = list(model.parameters())
        self.device = params[0].device if params else torch.device("cpu")
        self._cuda = dev.is_cuda(self.device)
        self._streams = [dev.new_stream(self.device) for _ in range(plan.num_streams)]
        self._capture_stream = dev.new_stream(self.device)
        self._in_step = False
        self._target: Tensor | None = None
        self._aux_values: list[Tensor] = []
        self._deferred: list[Tensor] = []
        self._pending: list[Future] = []
        self._graph_owned: set[int] = set()
        self._dispatch = plan.dispatch
        self._pool: ThreadPoolExecutor | None = None
        self._step_graph: torch.cuda.CUDAGraph | None = None
        self._step_static: tuple[list[Tensor], Tensor, Tensor] | None = None
        self._steps = 0
        self.capture_retries = 0
        """Whole-step captures that failed once and succeeded on the retry."""

        heads = self._build_heads(example, make_head or _default_head) if plan.cuts else {}
        self._head_modules = nn.ModuleList(heads.values())
        self.heads: Mapping[str, nn.Module] = MappingProxyType(heads)
        self.optimizer = (optimizer or functools.partial(torch.optim.Adam, lr=1e-3))(self.parameters())
        if plan.whole_step_graph and self._cuda:
            for group in self.optimizer.param_groups:
                if "capturable" in group:
                    group["capturable"] = True
        self._runners: list[_CutRunner] = []
        self._patched: list[nn.Module] = []
        modules = dict(model.named_modules())
        for i, cut in enumerate(plan.cuts):
            runner = _CutRunner(self, i, cut, [modules[m] for m in cut.members], heads[cut.name])
            self._runners.append(runner)
            first, *rest = runner.modules
            first.forward = runner  # instance attribute shadows the class's forward
            self._patched.append(first)
            for m in rest:
                m.forward = _Passthrough(m)
                self._patched.append(m)

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
            if self.plan.whole_step_graph and self._cuda:
                return self._graph_step(inputs, target)
            self._zero_grad()
            loss = self.forward_backward(inputs, target)
            self.optimizer.step()
            self._steps += 1
            return loss

    def forward_backward(self, inputs: Tensor | Sequence[Any], target: Tensor) -> Tensor:
        """Compute gradients for one batch (no optimizer step, no zeroing); eager path."""
        inputs = _as_tuple(inputs)
        self._in_step, self._target = True, target
        self._aux_values, self._deferred = [], []
        try:
            with torch.enable_grad():
                out = self.model(*inputs)
                main = self.loss_fn(out, target)
                if self._deferred:
                    (main + sum(self._deferred)).backward()
                else:
                    main.backward()
            self._join()
        finally:
            self._in_step, self._target = False, None
            self._deferred = []
        loss = main.detach()
        for aux in self._aux_values:
            loss = loss + aux
        self._aux_values = []
        return loss

    def close(self) -> None:
        """Restore the model's own forwards and stop the worker thread."""
        for m in self._patched:
            m.__dict__.pop("forward", None)
        self._patched = []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> EraseEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _build_heads(self, example: tuple[Any, Tensor] | None, make_head: HeadFactory) -> dict[str, nn.Module]:
        if example is None:
            raise PlanError("EraseEngine needs example=(inputs, target) to size the aux heads of a plan with cuts")
        inputs, _ = example
        modules = dict(self.model.named_modules())
        outs: dict[str, Tensor] = {}
        hooks = []
        for cut in self.plan.cuts:
            last = modules[cut.members[-1]]
            hooks.append(last.register_forward_hook(functools.partial(_keep_output, outs, cut.name)))
        was_training = self.model.training
        self.model.eval()  # the probe must not move BatchNorm statistics
        try:
            with torch.no_grad():
                model_out = self.model(*_as_tuple(inputs))
        finally:
            self.model.train(was_training)
            for h in hooks:
                h.remove()
        heads: dict[str, nn.Module] = {}
        for cut in self.plan.cuts:
            out = outs.get(cut.name)
            if not isinstance(out, Tensor):
                raise PlanError(f"cut {cut.name!r}: the module did not return a single tensor in the probe forward")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(zlib.crc32(cut.name.encode()))  # same head init in every engine
                head = make_head(cut.name, out, model_out).to(device=out.device, dtype=out.dtype)
            with torch.no_grad():
                probe = head(out)
            if probe.shape != model_out.shape:
                raise PlanError(
                    f"cut {cut.name!r}: aux head maps output {tuple(out.shape)} to {tuple(probe.shape)}, "
                    f"but the model's output is {tuple(model_out.shape)}; pass make_head for this cut"
                )
            heads[cut.name] = head
        return heads

    def _side_stream(self, index: int):
        return self._streams[index - 1] if index > 0 else None

    def _launch_backward(self, aux: Tensor, stream) -> None:
        mode = self._dispatch
        if mode == "deferred":
            self._deferred.append(aux)
        elif mode == "threaded":
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="erase-bwd", initializer=self._init_worker)
            self._pending.append(self._pool.submit(_backward_on, aux, stream))
        else:
            _backward_on(aux, stream)

    def _init_worker(self) -> None:
        if self._cuda:  # a worker thread does not inherit the current device
            torch.cuda.set_device(self.device)

    def _drain_workers(self) -> None:
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()  # re-raises a worker's exception in the training thread

    def _join(self) -> None:
        # Kernels must be queued before wait_stream records its event: drain the workers first.
        self._drain_workers()
        main = dev.current_stream(self.device)
        for s in self._streams:
            dev.wait_stream(main, s)

    def _zero_grad(self) -> None:
        for p in self.parameters():
            if id(p) not in self._graph_owned:
                p.grad = None

    def _graph_step(self, inputs: tuple, target: Tensor) -> Tensor:
        main = dev.current_stream(self.device)
        cap = self._capture_stream
        if self._step_graph is None:
            self._dispatch = "deferred" if self.plan.dispatch == "deferred" else "blocking"
            if self._steps < self.graph_warmup:  # eager warm-up on a side stream, as capture requires
                dev.wait_stream(cap, main)
                with dev.use_stream(cap):
                    self._zero_grad()
                    loss = self.forward_backward(inputs, target)
                    self.optimizer.step()
                dev.wait_stream(main, cap)
                self._steps += 1
                return loss
            self._capture_step(inputs, target)
        static_in, static_target, static_loss = self._step_static  # type: ignore[misc]
        live = _tensors(inputs)
        if len(live) != len(static_in) or any(s.shape != x.shape or s.dtype != x.dtype for s, x in zip(static_in, live)):
            raise CaptureError(
                "whole-step CUDA graph was captured for inputs "
                f"{[tuple(s.shape) for s in static_in]}, got {[tuple(x.shape) for x in live]}; it needs static shapes"
            )
        for s, x in zip(static_in, live):
            s.copy_(x)
        static_target.copy_(target)
        self._step_graph.replay()  # type: ignore[union-attr]
        self._steps += 1
        return static_loss

    def _capture_step(self, inputs: tuple, target: Tensor) -> None:
        main = dev.current_stream(self.device)
        cap = self._capture_stream
        static_inputs = tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, inputs)
        static_target = target.clone()
        # One retry: a capture can be invalidated by unrelated work elsewhere in the process
        # (seen once on an H200 with the GPT proxy); a second failure is the workload's own.
        for attempt in (1, 2):
            for p in self.parameters():
                p.grad = None  # grads come from the graph's pool; every replay overwrites them
            graph = torch.cuda.CUDAGraph()
            dev.wait_stream(cap, main)
            try:
                with torch.cuda.graph(graph, stream=cap):
                    loss = self.forward_backward(static_inputs, static_target)
                    self.optimizer.step()
                break
            except (RuntimeError, torch.cuda.CudaError) as e:  # type: ignore[attr-defined]
                self._deferred, self._aux_values, self._pending = [], [], []
                if attempt == 2:
                    raise CaptureError(
                        f"whole-step CUDA graph capture failed ({str(e).splitlines()[0]}); the step must have "
                        "static shapes and no CPU syncs (.item(), .cpu(), data-dependent control flow)"
                    ) from e
                self.capture_retries += 1
                dev.synchronize(self.device)
        dev.wait_stream(main, cap)
        self._graph_owned.update(id(p) for p in self.parameters())
        self._step_graph = graph
        self._step_static = (_tensors(static_inputs), static_target, loss)


def _backward_on(aux: Tensor, stream) -> None:
    # The gradient seed is created on the current stream: make it the cut's stream.
    with dev.use_stream(stream):
        aux.backward()


class _Passthrough:
    """Forward of a later block of a run: the run's first block already applied it."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x

    def __deepcopy__(self, memo: dict) -> Any:
        return _unpatched_copy(self.module, memo)


def _unpatched_copy(module: nn.Module, memo: dict) -> Any:
    # A deep copy of a model with an engine attached is a plain model: its copied modules get
    # their class's own forward back (copy.deepcopy registers the copy in memo before its state).
    copied = memo.get(id(module), module)
    return type(copied).forward.__get__(copied)


def _keep_output(store: dict[str, Tensor], name: str, module: nn.Module, args: Any, output: Any) -> None:
    store[name] = output


def _as_tuple(inputs: Any) -> tuple:
    if isinstance(inputs, Tensor):
        return (inputs,)
    return tuple(inputs)
