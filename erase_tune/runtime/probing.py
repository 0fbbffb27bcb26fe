"""One probe forward that tells whether a plan can work on a model, before any timing.

A plan can name real modules and still be wrong for the model: a module the forward never
calls, a "run" of blocks the parent does not call as a chain (parallel towers, embedding
tables), a cut that returns a tuple, a cut at the model's output (the main loss would then
have no gradient path), or cuts that leave parameters with no gradient at all (everything
upstream of a cut whose input is detached). Each would otherwise surface as a deep torch
error, or worse as silently different training. :func:`probe` runs the model once on one
example batch (grad enabled, every module in eval mode so BatchNorm statistics do not move,
the RNG state restored) with each target's forward wrapped to record its calls, then keeps
a compact copy of the autograd graph so that any plan over those targets can be checked
without running the model again. The engine and the tuning service share it.

Gradient reachability is read off the graph: walking ``grad_fn.next_functions`` from the
model output, an ``AccumulateGrad`` node's ``variable`` is the parameter it feeds. A table
that a fused kernel updates inside its backward (TorchRec's sharded and fused embedding
tables, FBGEMM's table-batched embeddings) shows up as one flat leaf that the model's named
parameters are views of: its node feeds every parameter sharing its storage, so those count
as trained when a loss reaches the kernel, although their ``.grad`` stays ``None``. Under a
plan the main walk stops at every cut's output node, and each cut's local walk starts at
its output node and stops at its input nodes, as detaching does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from erase_tune.errors import EraseTuneError, PlanError, shown
from erase_tune.runtime.losscheck import select_output, task_tensors
from erase_tune.runtime.plan import ErasePlan, check_in_model, members_of

__all__ = ["ProbeResult", "FirstStepCheck", "probe"]

_NAMES_SHOWN = 5
_VIEWS = {"ViewBackward", "SqueezeBackward", "UnsqueezeBackward", "ReshapeAliasBackward", "UnsafeViewBackward",
          "CloneBackward", "AliasBackward"}
_ACTIVATIONS = {"SigmoidBackward": "sigmoid", "SoftmaxBackward": "softmax", "LogSoftmaxBackward": "log_softmax"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Graph:
    """The probe's autograd graph as plain indices (the tensors themselves are released)."""

    children: tuple[tuple[int, ...], ...]
    """For each node, the nodes its gradient flows to (``next_functions``)."""
    params: Mapping[int, str]
    """``AccumulateGrad`` nodes of the model's trainable parameters, by parameter name."""
    shared: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """``AccumulateGrad`` nodes of leaves that are no named parameter but share storage with
    some (a fused kernel's flat table): the parameters that are views of it."""
    roots: frozenset[int]
    """The nodes of the model output's tensors."""
    order: tuple[str, ...]
    """Every trainable parameter's name, in the model's order (for messages)."""

    def walk(self, starts: Iterable[int], stop: frozenset[int] = frozenset()) -> set[int]:
        """Nodes reachable from ``starts`` without entering a node of ``stop``."""
        seen: set[int] = set()
        todo = [n for n in starts if n not in stop]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo.extend(c for c in self.children[n] if c not in stop and c not in seen)
        return seen

    def params_of(self, nodes: Iterable[int]) -> set[str]:
        nodes = list(nodes)
        found = {self.params[n] for n in nodes if n in self.params}
        return found.union(*(self.shared[n] for n in nodes if n in self.shared))

    def ordered(self, names: set[str]) -> tuple[str, ...]:
        return tuple(n for n in self.order if n in names)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Facts:
    """What the probe saw of one target."""

    call_problem: str | None
    """Why the target cannot run as one piece (never called, not a chain), after its quoted name."""
    output_type: str
    """Type name of what the target (a run's last block) returned on its first call."""
    in_nodes: frozenset[int]
    """Graph nodes of the target's inputs (a run's first block)."""
    out_nodes: frozenset[int]
    """Graph nodes of the target's output tensors (a run's last block), less its inputs'."""
    graph_problem: str | None = None
    """Why the target cannot be captured as a CUDA graph piece, after its quoted name."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """What one probe forward showed about a model and a set of targets."""

    model_name: str
    """The model's class name, for messages."""
    model_output: Any
    """The probe's model output (detached)."""
    outputs: Mapping[str, Tensor]
    """Each target's output (a run's last block; detached), for targets that return one tensor."""
    output_activation: Any
    """How the model output was produced: ``sigmoid``, ``softmax``, ``log_softmax`` or ``none``
    (a multi-task prediction: a dict of them, by task)."""
    facts: Mapping[str, _Facts]
    """Per probed target: calls, output type, graph nodes."""
    graph: _Graph
    """The autograd graph of the probe forward."""
    trainable: tuple[str, ...]
    """Parameters the plain model's loss gives a gradient, by name, in the model's order."""
    fused: tuple[str, ...] = ()
    """Of ``trainable``, those a fused kernel updates in backward (their ``.grad`` stays None)."""

    def check_cut(self, target: str) -> None:
        """Raise a one-line :class:`PlanError` if ``target`` cannot be a cut."""
        facts = self._facts("cut", target)
        if facts.call_problem:
            raise PlanError(f"cut {shown(target)}{facts.call_problem}")
        if facts.output_type != "Tensor":
            raise PlanError(f"cut {shown(target)}: the module returns {facts.output_type}, but a cut must "
                            "return one tensor (its output is detached and fed to the aux head)")
        if self.trainable and not self._main_params(facts.out_nodes):
            raise PlanError(f"cut {shown(target)} produces the model's output: detaching it leaves the main loss "
                            "with no gradient path (cut a module further from the output, or place it instead)")

    def check_placement(self, target: str) -> None:
        """Raise a one-line :class:`PlanError` if ``target`` cannot be placed on a side stream."""
        facts = self._facts("placement", target)
        if facts.call_problem:
            raise PlanError(f"placement {shown(target)}{facts.call_problem}")

    def check_graphed(self, target: str) -> None:
        """Raise a one-line :class:`PlanError` if ``target`` cannot be a graphed piece."""
        facts = self._facts("graphed piece", target)
        problem = facts.call_problem or facts.graph_problem
        if problem:
            raise PlanError(f"graphed piece {shown(target)}{problem}")

    def untrained(self, plan: ErasePlan) -> tuple[str, ...]:
        """Parameter names that get a gradient in the plain model but none under ``plan``."""
        return self.graph.ordered(set(self.trainable) - self._trained(plan))

    def check_plan(self, plan: ErasePlan) -> None:
        """Every check above, for every cut and placement of ``plan``, then the plan as a whole."""
        for cut in plan.cuts:
            self.check_cut(cut.module)
        for placement in plan.placements:
            self.check_placement(placement.module)
        for graphed in plan.graphs:
            self.check_graphed(graphed.module)
        starved = self.untrained(plan)
        if starved:
            raise PlanError(self.starved_message(plan, starved))
        stops = frozenset().union(*(self.facts[c.module].out_nodes for c in plan.cuts))
        if self.trainable and not self._main_params(stops):
            names = ", ".join(shown(c.module) for c in plan.cuts)
            raise PlanError(f"cuts {names} together cut the model's output off every parameter: "
                            "the main loss would have no gradient path")

    def starved_message(self, plan: ErasePlan, starved: Sequence[str]) -> str:
        """The one-line error for parameters ``plan`` leaves without a gradient."""
        names = ", ".join(starved[:_NAMES_SHOWN]) + (", …" if len(starved) > _NAMES_SHOWN else "")
        g = self.graph
        blamed = [c.module for c in plan.cuts
                  if g.params_of(g.walk(self.facts[c.module].in_nodes)) & set(starved)]
        if len(blamed) == 1:
            why = f"cut {shown(blamed[0])} detaches everything upstream of it"
        elif blamed:
            why = f"cuts {', '.join(shown(b) for b in blamed)} together detach everything upstream of them"
        else:
            why = "no cut's local loss reaches them and the main loss does not either"
        return f"plan leaves {len(starved)} parameters untrained: {names} ({why})"

    # -- internals ------------------------------------------------------------------------------

    def _facts(self, kind: str, target: str) -> _Facts:
        facts = self.facts.get(target)
        if facts is None:
            raise PlanError(f"{kind} {shown(target)} was not among the probed targets")
        return facts

    def _main_params(self, stop: frozenset[int]) -> set[str]:
        return self.graph.params_of(self.graph.walk(self.graph.roots, stop))

    def _trained(self, plan: ErasePlan) -> set[str]:
        facts = [self._facts("cut", c.module) for c in plan.cuts]
        outs = frozenset().union(*(f.out_nodes for f in facts))
        trained = self._main_params(outs)
        for f in facts:
            local_stop = (outs - f.out_nodes) | f.in_nodes
            trained |= self.graph.params_of(self.graph.walk(f.out_nodes, local_stop))
        return trained



class FirstStepCheck:
    """After an engine's first backward: every parameter the plain model trains was reached.

    A parameter counts as reached when it holds a gradient, or when one was accumulated into
    it during that backward (an optimizer applied in backward then sets ``.grad`` back to
    None: hooks note it); tables a fused kernel updates have no gradient to see (the probe
    checked them). Under a process group, a gradient the reducer filled with zeros is none.
    """

    def __init__(self, result: ProbeResult, model: nn.Module) -> None:
        self.result, self.model, self.done = result, model, False
        self._reached: set[int] = set()
        named = dict(model.named_parameters())
        self._hooks = [named[n].register_post_accumulate_grad_hook(lambda t: self._reached.add(id(t)))
                       for n in result.trainable if n not in result.fused and named[n].is_leaf]

    def check(self, plan: ErasePlan, filled: set[int]) -> None:
        """Raise the one-line starvation error for the parameters the first step left untrained."""
        self.done = True
        self.close()
        named = dict(self.model.named_parameters())
        fused = set(self.result.fused)
        missing = [n for n in self.result.trainable if n not in fused and (
            (named[n].grad is None and id(named[n]) not in self._reached) or id(named[n]) in filled)]
        self._reached = set()
        if missing:
            raise PlanError(self.result.starved_message(plan, missing))

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def probe(model: nn.Module, inputs: tuple, targets: Sequence[str], *,
          output: Callable[[Any], Tensor] | None = None,
          model_loss: Callable[[Any], Tensor] | None = None) -> ProbeResult:
    """Run ``model(*inputs)`` once and record what each target (name or run) does in it.

    Targets may overlap (the service probes all candidates at once). A target that names no
    module of ``model`` raises :class:`PlanError`. ``output`` picks the prediction out of a
    structured model output (see :func:`select_output`); the checks and heads then see it alone.
    ``model_loss`` picks the loss a model computes itself: gradient paths start there.
    """
    select = output
    modules = dict(model.named_modules())
    model_name = type(model).__name__
    for target in targets:
        check_in_model(f"target {shown(target)}", target, modules, model_name)
    watched = list(dict.fromkeys(m for t in targets for m in members_of(t)))
    calls: dict[str, list[_Call]] = {m: [] for m in watched}
    with _recording(modules, calls), _eval(model), _forked_rng(model), torch.enable_grad():
        output = model(*inputs)
    loss = select_output(model_loss, output, "model_loss") if model_loss is not None else None
    if select is not None:
        output = select_output(select, output)
    records = {t: _target_record(t, calls, model_name) for t in targets}
    nodes = _Nodes(model, _tensor_leaves(output if loss is None else loss),
                   [x for rec in records.values() for x in rec.outs])
    facts = {t: _facts(rec, nodes) for t, rec in records.items()}
    graph = nodes.graph
    trainable = graph.ordered(graph.params_of(graph.walk(graph.roots)))
    fused = set().union(*graph.shared.values())
    return ProbeResult(
        model_name=model_name,
        model_output=tree_map(lambda x: x.detach() if isinstance(x, Tensor) else x, output),
        outputs={t: rec.first_out.detach() for t, rec in records.items() if isinstance(rec.first_out, Tensor)},
        output_activation=_activation(output),
        facts=facts,
        graph=graph,
        trainable=trainable,
        fused=tuple(n for n in trainable if n in fused),
    )


# -- recording the forward ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Call:
    """One call of a watched module's forward."""

    seq: int
    """Order in which the call started, over all watched modules."""
    args: tuple
    """Positional arguments."""
    kwargs: dict
    """Keyword arguments."""
    out: Any
    """What it returned."""


@contextlib.contextmanager
def _recording(modules: Mapping[str, nn.Module], calls: dict[str, list[_Call]]) -> Iterator[None]:
    """Wrap each watched module's forward (an instance attribute, as the engine patches it, so
    direct ``module.forward(...)`` calls are seen too); restore exactly what was there."""
    counter = itertools.count()
    saved: list[tuple[nn.Module, Any]] = []
    try:
        for name, log in calls.items():
            module = modules[name]
            saved.append((module, module.__dict__.get("forward")))
            module.forward = _recorder(module.forward, log, counter)
        yield
    finally:
        for module, own in saved:
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own


def _recorder(forward: Callable, log: list[_Call], counter: itertools.count) -> Callable:
    def record(*args: Any, **kwargs: Any) -> Any:
        seq = next(counter)
        out = forward(*args, **kwargs)
        log.append(_Call(seq=seq, args=args, kwargs=kwargs, out=out))
        return out

    return record


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode for the probe; each module's own flag restored after."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _forked_rng(model: nn.Module) -> Any:
    """The probe must not move the RNG: a plan with a probe trains like one without."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    return torch.random.fork_rng(devices=devices)


def _tensor_leaves(tree: Any) -> list[Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Record:
    """A target's calls, reduced to what the checks need."""

    problem: str | None
    """A call-structure problem, phrased after the target's quoted name."""
    first_out: Any
    """What the target returned on its first call (None if never called)."""
    ins: list[Tensor]
    """Input tensors of every call (a run's first block)."""
    outs: list[Tensor]
    """Output tensors of every call (a run's last block)."""
    chain: list[tuple[str, str, Any, Any]]
    """For a run: (block, next block, block's output, next block's output) per link."""
    graph_problem: str | None = None
    """What keeps the target from being replayed as a CUDA graph piece, if anything."""


def _target_record(target: str, calls: Mapping[str, list[_Call]], model_name: str) -> _Record:
    members = members_of(target)
    logs = [calls[m] for m in members]
    first, last = logs[0], logs[-1]
    problem = None
    if not any(logs):
        what = "the module is" if len(members) == 1 else "its blocks are"
        problem = f": {what} never called in {model_name}'s forward"
    elif len(members) > 1:
        problem = _chain_problem(members, logs)
    links = []
    if problem is None and len(members) > 1:
        links = [(members[i], members[i + 1], logs[i][0].out, logs[i + 1][0].out) for i in range(len(members) - 1)]
    return _Record(
        problem=problem,
        first_out=last[0].out if last else None,
        ins=[x for c in first for x in _tensor_leaves((c.args, c.kwargs))],
        outs=[x for c in last for x in _tensor_leaves(c.out)],
        chain=links,
        graph_problem=_graph_problem(first, last),
    )


def _graph_problem(first: Sequence[_Call], last: Sequence[_Call]) -> str | None:
    """A CUDA-graphed piece is replayed with static buffers: once per forward, tensors in and out."""
    if len(first) != 1:
        return (f": the module is called {len(first)} times in one forward; a graphed piece must be called once "
                "(each replay overwrites the previous call's outputs)")
    call, out = first[0], last[0].out if last else None
    if call.kwargs or not all(isinstance(a, Tensor) for a in call.args):
        kinds = [type(a).__name__ for a in call.args if not isinstance(a, Tensor)] + [f"{k}=" for k in call.kwargs]
        return (f": the module takes {', '.join(kinds[:3])}; a graphed piece must take tensors only, as positional "
                "arguments (place it instead)")
    outs = out if isinstance(out, tuple) else (out,)
    if not all(isinstance(o, Tensor) for o in outs):
        return f": the module returns {type(out).__name__}; a graphed piece must return a tensor or a tuple of tensors"
    return None


def _chain_problem(members: Sequence[str], logs: Sequence[list[_Call]]) -> str | None:
    why = "(a run's blocks must be called once each, one after another, each on the previous block's output alone)"
    for name, log in zip(members, logs):
        if len(log) != 1:
            times = "never called" if not log else f"called {len(log)} times"
            return f" is not a chain: {name} is {times} {why}"
    for (a, la), (b, lb) in zip(zip(members, logs), zip(members[1:], logs[1:])):
        prev, call = la[0], lb[0]
        if call.seq < prev.seq:
            return f" is not a chain: {b} is called before {a} {why}"
        taken = call.args[0] if call.args else next(iter(call.kwargs.values()), None)
        if taken is not prev.out:
            return f" is not a chain: {b} does not take {a}'s output {why}"
        if len(call.args) + len(call.kwargs) != 1:
            return f" is not a chain: {b} takes more than {a}'s output {why}"
    return None


# -- the graph ---------------------------------------------------------------------------------------


class _Nodes:
    """Numbers every autograd node reachable from the output (and from the targets' outputs).

    Python wrappers of autograd nodes are cached only while referenced, so ``id(node)`` is a
    stable key only while this object holds them: look tensors up before letting it go.
    """

    def __init__(self, model: nn.Module, roots: Sequence[Tensor], extra: Sequence[Tensor]) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        names = {id(p): n for n, p in named}
        by_storage: dict[int, list[str]] = {}
        for n, p in named:
            key = _storage(p)
            if key is not None:
                by_storage.setdefault(key, []).append(n)
        shared: dict[int, tuple[str, ...]] = {}
        self.index: dict[int, int] = {}
        self.nodes: list[Any] = []
        root_ids = frozenset(self._number(t.grad_fn) for t in roots if t.grad_fn is not None)
        for t in extra:
            if t.grad_fn is not None:
                self._number(t.grad_fn)
        children: list[tuple[int, ...]] = []
        params: dict[int, str] = {}
        self.leaves: dict[int, int] = {}  # id(leaf tensor) -> its AccumulateGrad node
        i = 0
        while i < len(self.nodes):  # the list grows as children are numbered: breadth-first
            node = self.nodes[i]
            children.append(tuple(self._number(n) for n, _ in node.next_functions if n is not None))
            variable = getattr(node, "variable", None)
            if variable is not None:
                self.leaves[id(variable)] = i
                if id(variable) in names:
                    params[i] = names[id(variable)]
                elif variable.numel():
                    views = by_storage.get(_storage(variable))  # type: ignore[arg-type]
                    if views:
                        shared[i] = tuple(views)
            i += 1
        self.graph = _Graph(children=tuple(children), params=params, roots=root_ids, order=tuple(names.values()),
                            shared=shared)

    def _number(self, node: Any) -> int:
        key = id(node)
        if key not in self.index:
            self.index[key] = len(self.nodes)
            self.nodes.append(node)
        return self.index[key]

    def of(self, t: Tensor) -> int | None:
        """The node of ``t``: its grad_fn, or for a leaf its AccumulateGrad (None if not in the graph)."""
        if t.grad_fn is not None:
            return self.index.get(id(t.grad_fn))
        return self.leaves.get(id(t))


def _storage(t: Tensor) -> int | None:
    """Where ``t``'s data lives (views of one flat table share it); None where that is not a
    plain storage (meta tensors, sparse or distributed tensor subclasses)."""
    if t.device.type == "meta" or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _facts(rec: _Record, nodes: _Nodes) -> _Facts:
    in_nodes = frozenset(n for n in map(nodes.of, rec.ins) if n is not None)
    out_nodes = frozenset(n for n in map(nodes.of, rec.outs) if n is not None) - in_nodes
    out = rec.first_out
    output_type = "Tensor" if isinstance(out, Tensor) else "None" if out is None else type(out).__name__
    return _Facts(
        call_problem=rec.problem or _escaping_link(rec, nodes),
        output_type=output_type,
        in_nodes=in_nodes,
        out_nodes=out_nodes,
        graph_problem=rec.graph_problem,
    )


def _escaping_link(rec: _Record, nodes: _Nodes) -> str | None:
    """A run whose intermediate output is used outside the next block: running the run as one
    piece would hand those users the run's final output instead."""
    graph = nodes.graph
    consumers: dict[int, list[int]] | None = None
    for block, nxt, out, next_out in rec.chain:
        if not isinstance(out, Tensor) or not isinstance(next_out, Tensor) or out is next_out:
            continue
        mid, end = nodes.of(out), nodes.of(next_out)
        if mid is None or end is None or mid == end:
            continue
        if consumers is None:
            consumers = {}
            for n, kids in enumerate(graph.children):
                for k in kids:
                    consumers.setdefault(k, []).append(n)
        inside = graph.walk([end], frozenset([mid]))
        if mid in graph.roots or any(c not in inside for c in consumers.get(mid, ())):
            return (f" is not a chain: {block}'s output is also used outside {nxt} (the run would hand "
                    "that user the run's last output instead)")
    return None


def _activation(output: Any) -> Any:
    """``sigmoid``/``softmax``/``log_softmax`` if the output comes from one (through views), else
    ``none``; for a multi-task prediction, a dict of them by task."""
    if task_tensors(output):
        return {k: _activation(v) for k, v in output.items()}
    return output_activation(output)


def output_activation(output: Any) -> str:
    """The activation one output tensor comes from (see :func:`_activation`)."""
    node = output.grad_fn if isinstance(output, Tensor) else None
    while node is not None:
        kind = re.sub(r"\d+$", "", type(node).__name__)
        if kind in _ACTIVATIONS:
            if kind != "SigmoidBackward" and not _last_dim(node):
                return "none"
            return _ACTIVATIONS[kind]
        if kind not in _VIEWS or not node.next_functions:
            return "none"
        node = node.next_functions[0][0]
    return "none"


def _last_dim(node: Any) -> bool:
    """Whether a (log-)softmax node normalised over the last dimension, as the default head will."""
    dim, result = getattr(node, "_saved_dim", None), getattr(node, "_saved_result", None)
    if dim is None or result is None or result.dim() == 0:
        return False
    if dim >= 1 << 63:  # exposed as an unsigned 64-bit value: -1 reads as 2**64 - 1
        dim -= 1 << 64
    return dim % result.dim() == result.dim() - 1
