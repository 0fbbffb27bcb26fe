"""The ERASE plan: where to cut a model, on which stream, how to dispatch, what to graph.

A plan is what `erase-tune export` writes and production training loads. It is a frozen,
versioned, validated dataclass; YAML is read with ``yaml.safe_load`` only, so loading a plan
never executes code from the file. Every error names the field (and the file) at fault.

A target (of a cut or a placement) is either a dotted submodule name (``subarchs.0``) or a
run of consecutive blocks of a ``ModuleList``/``Sequential`` written ``blocks.2:5`` (blocks
2, 3 and 4, which the parent must call as a chain: each block on the previous block's output).

A *cut* detaches its target and gives it a local loss; a *placement* only runs its target's
forward on a side stream, without detaching anything, so it never changes a gradient
(autograd runs each op's backward on the stream its forward ran on); a *graphed* piece has
its forward and backward captured as a CUDA graph and replayed inside an otherwise eager
step, again without detaching it (optionally on a side stream too), which removes its host
launch cost.

Plan files come from users, so every size is bounded before any work that grows with it:
at most :data:`MAX_TARGETS` cuts and placements, runs of at most :data:`MAX_RUN` blocks
(overlap is decided on intervals, never by listing a run's members) and at most
:data:`MAX_STREAMS` side streams.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from erase_tune._files import aux_weight_problem, load_yaml, name_problem, read_text
from erase_tune.errors import PlanError, one_line, shown

if TYPE_CHECKING:  # torch is imported where a model is checked: reading a plan needs none
    from torch import nn

__all__ = [
    "PLAN_VERSION",
    "DISPATCH_MODES",
    "MAX_TARGETS",
    "MAX_STREAMS",
    "MAX_RUN",
    "Cut",
    "Placement",
    "Graphed",
    "ErasePlan",
    "targets_overlap",
]

PLAN_VERSION = 1
DISPATCH_MODES = ("blocking", "threaded", "deferred")
"""``blocking``: the main thread launches each cut's backward right after its forward.
``threaded``: a worker thread launches it, so the main thread keeps dispatching forward work.
``deferred``: no early launch; aux losses join the main loss in one backward at the end
(the "detach only" twin of a plan: same work removed, no overlap)."""
MAX_TARGETS = 1024
"""Most cuts and placements, together, in one plan."""
MAX_STREAMS = 64
"""Most side streams a plan may ask for (each is a CUDA stream the engine creates)."""
MAX_RUN = 100_000
"""Most blocks in one run ``parent.start:stop``."""

_INDEX_DIGITS = 9  # run bounds below 10**9: int() of a digit string stays cheap
_RUN = re.compile(r"^(?P<parent>\w+(?:\.\w+)*)\.(?P<start>[0-9]+):(?P<stop>[0-9]+)$")
_NAME = re.compile(r"^\w+(?:\.\w+)*$")
_FIELD = re.compile(r"^\w{1,40}$")

_Target = tuple[tuple[str, ...], "tuple[int, int] | None"]  # dotted path (a run's parent), run bounds


def _parse(module: str) -> _Target:
    """Parse a target already checked by :func:`_check_target`."""
    run = _RUN.match(module)
    if run:
        return tuple(run["parent"].split(".")), (int(run["start"]), int(run["stop"]))
    return tuple(module.split(".")), None


def _check_target(module: Any) -> None:
    """Raise ``PlanError("module: ...")`` unless ``module`` is a name or a bounded, non-empty run."""
    if not isinstance(module, str) or not module:
        raise PlanError(f"module: {shown(module)} must be a non-empty string")
    run = _RUN.match(module)
    if not run:
        if not _NAME.match(module):
            raise PlanError(f"module: {shown(module)} is neither a dotted module name nor a run 'parent.start:stop'")
    # \w admits invisible letters and look-alikes (Hangul fillers, full-width forms)
    problem = name_problem(run["parent"] if run else module, dotted=True)
    if problem:
        raise PlanError(f"module: {shown(module)} {problem}")
    if not run:
        return
    if len(run["start"]) > _INDEX_DIGITS or len(run["stop"]) > _INDEX_DIGITS:
        raise PlanError(f"module: run {shown(module)} has a bound of more than {_INDEX_DIGITS} digits")
    start, stop = int(run["start"]), int(run["stop"])
    if start >= stop:
        raise PlanError(f"module: run {shown(module)} is empty (start must be < stop)")
    if stop - start > MAX_RUN:
        raise PlanError(f"module: run {shown(module)} has {stop - start} blocks, more than the limit of {MAX_RUN}")


def members_of(module: str) -> tuple[str, ...]:
    """The submodule names a target covers, in call order (only for a run checked against a model)."""
    (parent, run) = _parse(module)
    if run is None:
        return (module,)
    prefix = ".".join(parent)
    return tuple(f"{prefix}.{i}" for i in range(*run))


def _index(component: str) -> int:
    """A path component as a block index, or -1 if it cannot be one."""
    if component.isascii() and component.isdigit() and len(component) <= _INDEX_DIGITS:
        return int(component)
    return -1


def _overlap(a: _Target, b: _Target) -> bool:
    (p, r), (q, s) = a, b
    if r is None and s is None:  # two names: one is the other or contains it
        n = min(len(p), len(q))
        return p[:n] == q[:n]
    if r is None:
        (p, r), (q, s) = (q, s), (p, r)
    k = len(p)  # from here (p, r) is a run
    if s is None:  # a name: the run's parent or above, or inside one of the run's blocks
        if len(q) <= k:
            return q == p[: len(q)]
        return q[:k] == p and r[0] <= _index(q[k]) < r[1]
    m = len(q)
    if m == k:
        return p == q and r[0] < s[1] and s[0] < r[1]
    if m > k:  # the other run lies inside one of this run's blocks, or elsewhere
        return q[:k] == p and r[0] <= _index(q[k]) < r[1]
    return p[:m] == q and s[0] <= _index(p[m]) < s[1]


def targets_overlap(a: str, b: str) -> bool:
    """Whether two targets (names or runs) share a module: one contains, is, or is inside the other.

    Decided from the names alone, in time independent of run lengths. A target that is not
    a valid name or run raises :class:`PlanError`.
    """
    for t in (a, b):
        _check_target(t)
    return _overlap(_parse(a), _parse(b))


def _first_overlap(targets: Sequence[str]) -> tuple[int, int] | None:
    """The first ``(j, i)``, ``i < j``, whose targets overlap; ``None`` if all are disjoint."""
    parsed = [_parse(t) for t in targets]
    for j, tj in enumerate(parsed):
        for i in range(j):
            if _overlap(tj, parsed[i]):
                return j, i
    return None


def _check_stream(value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_STREAMS:
        raise PlanError(f"stream: {shown(value)} must be an integer in {low}..{MAX_STREAMS}")


class _Element:
    """What every plan element shares: it names a module (or a run of blocks) of the model."""

    module: str

    @property
    def name(self) -> str:
        """The element's name: its module target, as written."""
        return self.module

    @property
    def members(self) -> tuple[str, ...]:
        """The submodule names this element covers, in call order (for a plan checked against its model)."""
        return members_of(self.module)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cut(_Element):
    """One detached piece of the model."""

    module: str
    """Dotted submodule name (``subarchs.0``) or a run of blocks ``blocks.2:5``."""
    stream: int = 0
    """0 runs the piece on the main stream; ``1..num_streams`` picks a side stream."""
    aux_weight: float = 1.0
    """λ: weight of the piece's local loss ``λ·ℓ(head(out), y)``; must be > 0."""
    graph: bool = False
    """Capture the piece's forward + local loss + backward as its own CUDA graph."""

    def __post_init__(self) -> None:
        _check_target(self.module)
        _check_stream(self.stream, 0)
        weight = self.aux_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise PlanError(f"aux_weight: {shown(weight)} must be a number")
        try:
            weight = float(weight)
        except OverflowError:
            weight = math.inf
        if not math.isfinite(weight) or weight <= 0:
            raise PlanError(f"aux_weight: {shown(self.aux_weight)} must be a finite number > 0")
        problem = aux_weight_problem(weight)  # float32's range (bf16's too); 0 and inf refused above
        if problem:
            raise PlanError(f"aux_weight: {shown(self.aux_weight)} {problem}")
        object.__setattr__(self, "aux_weight", weight)
        if not isinstance(self.graph, bool):
            raise PlanError(f"graph: {shown(self.graph)} must be true or false")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement(_Element):
    """A piece run on a side stream as it is: not detached, no aux head, gradients unchanged."""

    module: str
    """Dotted submodule name (``subarchs.2``) or a run of blocks ``blocks.2:5``."""
    stream: int
    """The side stream, ``1..num_streams`` (0, the main stream, would place nothing)."""

    def __post_init__(self) -> None:
        _check_target(self.module)
        if self.stream == 0 and not isinstance(self.stream, bool):
            raise PlanError("stream: 0 is the main stream; a placement needs a side stream 1..num_streams")
        _check_stream(self.stream, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Graphed(_Element):
    """A piece captured as a CUDA graph (forward and backward) and replayed inside an eager step.

    Not detached, no aux head: gradients equal the plain step's. The piece must take tensors
    only, as positional arguments, with static shapes, and do no CPU sync (what any CUDA graph
    needs); the engine refuses anything else in one line naming the piece. On the CPU it runs
    the piece as it is.
    """

    module: str
    """Dotted submodule name (``top_l``) or a run of blocks ``blocks.2:5``."""
    stream: int = 0
    """0 replays the graph on the main stream; ``1..num_streams`` also places it on that side stream."""

    def __post_init__(self) -> None:
        _check_target(self.module)
        _check_stream(self.stream, 0)


Target = Cut | Placement | Graphed
"""Any plan element: each names a module (or run) of the model, and no two may overlap."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ErasePlan:
    """Where and how ERASE detaches a model. A plan with no cuts and no placements is plain training."""

    cuts: tuple[Cut, ...] = ()
    """The detached pieces, in any order; no two targets (cuts or placements) may overlap."""
    placements: tuple[Placement, ...] = ()
    """Pieces run on a side stream without detaching them."""
    graphs: tuple[Graphed, ...] = ()
    """Pieces captured as CUDA graphs and replayed in an eager step, without detaching them."""
    num_streams: int = 0
    """Number of side CUDA streams cuts, placements and graphed pieces may use (0: everything on the main stream)."""
    dispatch: str = "blocking"
    """Who launches early backward: ``blocking``, ``threaded`` or ``deferred`` (see DISPATCH_MODES)."""
    whole_step_graph: bool = False
    """Capture the whole step (forward, early backwards, main backward, optimizer) as one
    CUDA graph. Launch order is then fixed at capture, so dispatch and per-cut graph flags
    have no effect (capture always runs blocking)."""
    find_unused_parameters: bool = False
    """Under a process group (``EraseEngine(..., process_group=pg)``), when gradients are
    averaged across ranks. ``true``: all of them at once, after the main backward. ``false``:
    each cut's own parameters (and its aux head's) as soon as that cut's local backward is
    done, asynchronously on the cut's stream, in plan order; the rest after the main backward.
    Named after DDP's flag (the paper's FUP), but the engine does its own reduction and never
    traverses the autograd graph. No effect without a process group."""
    version: int = PLAN_VERSION
    """Plan file format version."""
    provenance: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Where the plan came from (study, trial, measured gain, device, versions); informational.
    Plain data only: scalars, or one level of mapping or list of scalars."""

    def __post_init__(self) -> None:
        if type(self.version) is not int or self.version != PLAN_VERSION:  # 1.0 and true are not versions
            raise PlanError(f"version: {shown(self.version)} is not supported (this erase-tune reads version {PLAN_VERSION})")
        cuts = _items(self.cuts, "cuts", Cut)
        placements = _items(self.placements, "placements", Placement)
        graphs = _items(self.graphs, "graphs", Graphed)
        if len(cuts) + len(placements) + len(graphs) > MAX_TARGETS:
            raise PlanError(f"cuts: {len(cuts)} cuts, {len(placements)} placements and {len(graphs)} graphed pieces, "
                            f"more than the limit of {MAX_TARGETS}")
        object.__setattr__(self, "cuts", cuts)
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "graphs", graphs)
        n = self.num_streams
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_STREAMS:
            raise PlanError(f"num_streams: {shown(n)} must be an integer in 0..{MAX_STREAMS}")
        if self.dispatch not in DISPATCH_MODES:
            raise PlanError(f"dispatch: {shown(self.dispatch)} is not one of {', '.join(DISPATCH_MODES)}")
        for name in ("whole_step_graph", "find_unused_parameters"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name}: {shown(getattr(self, name))} must be true or false")
        object.__setattr__(self, "provenance", _plain_provenance(self.provenance))
        for i, cut in enumerate(cuts):
            if cut.graph and self.dispatch == "deferred":
                raise PlanError(
                    f"cuts[{i}].graph: a per-cut graph captures the cut's backward with its forward, "
                    "so it cannot be deferred (dispatch: deferred)"
                )
        for label, target in self._labelled():
            if target.stream > n:
                low = 1 if isinstance(target, Placement) else 0
                raise PlanError(f"{label}.stream: {target.stream} is out of range {low}..{n} (num_streams={n})")
        self._check_disjoint()

    def _labelled(self) -> list[tuple[str, Target]]:
        return ([(f"cuts[{i}]", c) for i, c in enumerate(self.cuts)]
                + [(f"placements[{i}]", p) for i, p in enumerate(self.placements)]
                + [(f"graphs[{i}]", g) for i, g in enumerate(self.graphs)])

    @property
    def targets(self) -> tuple[Target, ...]:
        """Every element of the plan: cuts, then placements, then graphed pieces."""
        return (*self.cuts, *self.placements, *self.graphs)

    def _check_disjoint(self) -> None:
        labelled = self._labelled()
        found = _first_overlap([t.module for _, t in labelled])
        if found is not None:
            (lj, tj), (li, ti) = labelled[found[0]], labelled[found[1]]
            raise PlanError(f"{lj}.module: {shown(tj.module)} overlaps {li}.module {shown(ti.module)}")

    # -- derived plans ---------------------------------------------------------------------

    def detach_only(self) -> ErasePlan:
        """The same cuts and aux heads with no early launch and no side streams: one stream,
        one backward at the end (placements and graphed pieces, which only change how work is
        launched, are dropped)."""
        cuts = tuple(dataclasses.replace(c, stream=0, graph=False) for c in self.cuts)
        return dataclasses.replace(self, cuts=cuts, placements=(), graphs=(), num_streams=0, dispatch="deferred")

    def without_cuts(self) -> ErasePlan:
        """This plan's execution settings (e.g. whole-step graph) with nothing detached, placed or graphed."""
        return dataclasses.replace(self, cuts=(), placements=(), graphs=(), num_streams=0, dispatch="blocking")

    @property
    def exact(self) -> bool:
        """Whether the plan trains the same mathematics as the plain model: it detaches nothing
        (placements and graphed pieces only change where and how work is launched)."""
        return not self.cuts

    def canonical(self) -> ErasePlan:
        """One representative of the plans that run identically.

        Side-stream ids are renumbered by first use over all elements together, in target
        order, and unused streams dropped (stream ids are interchangeable); with a whole-step
        graph, dispatch and per-cut graph flags are reset since they have no effect there, and
        a graphed piece is already inside the step's graph: on a side stream it is a
        placement, on the main stream nothing; elements are sorted by target.
        """
        placements, graphs = list(self.placements), list(self.graphs)
        if self.whole_step_graph:
            placements += [Placement(module=g.module, stream=g.stream) for g in graphs if g.stream]
            graphs = []
        cuts = sorted(self.cuts, key=lambda c: c.module)
        placements.sort(key=lambda p: p.module)
        graphs.sort(key=lambda g: g.module)
        remap: dict[int, int] = {}
        for t in sorted([*cuts, *placements, *graphs], key=lambda t: t.module):
            if t.stream and t.stream not in remap:
                remap[t.stream] = len(remap) + 1
        graph_ok = not self.whole_step_graph
        new_cuts = tuple(
            dataclasses.replace(c, stream=remap.get(c.stream, 0), graph=c.graph and graph_ok) for c in cuts
        )
        new_placements = tuple(dataclasses.replace(p, stream=remap[p.stream]) for p in placements)
        new_graphs = tuple(dataclasses.replace(g, stream=remap.get(g.stream, 0)) for g in graphs)
        dispatch = "blocking" if self.whole_step_graph and self.dispatch != "deferred" else self.dispatch
        if not new_cuts:
            dispatch = "blocking"
        return dataclasses.replace(self, cuts=new_cuts, placements=new_placements, graphs=new_graphs,
                                   num_streams=len(remap), dispatch=dispatch)

    def describe(self) -> str:
        """A one-line summary for tables and logs."""
        parts = [f"{c.module}@s{c.stream}{'+g' if c.graph else ''}" for c in self.cuts]
        parts += [f"{p.module}@s{p.stream}(placed)" for p in self.placements]
        parts += [f"{g.module}@s{g.stream}(graphed)" for g in self.graphs]
        what = ", ".join(parts) if parts else "no cuts"
        graph = ", whole-step graph" if self.whole_step_graph else ""
        return f"{what}; {self.num_streams} side stream(s), {self.dispatch}{graph}"

    # -- checks against a model --------------------------------------------------------------

    def under_wrapper(self, model: nn.Module) -> ErasePlan:
        """This plan with every module name that ``model`` holds only under a wrapper given the
        wrapper's prefix (DistributedModelParallel's ``_dmp_wrapped_module.``, and its DDP's
        ``module.`` within, torch.compile's ``_orig_mod.``, FSDP's): a plan tuned on the bare
        model, loaded onto the wrapped one. A name the model has as it is, or under no one
        wrapper path, is kept as it is (:meth:`check_model` says what is wrong with it)."""
        modules = dict(model.named_modules())

        def rename(target: Any) -> Any:
            name = target.module
            head, _, last = name.rpartition(".")
            container = head if ":" in last else name  # a run `blocks.0:2` lives in `blocks`
            if container in modules:
                return target
            prefixes = {n[: -len(container)] for n in modules if n.endswith("." + container)
                        and set(n[: -len(container) - 1].split(".")) <= _WRAPPER_ATTRS}
            return dataclasses.replace(target, module=prefixes.pop() + name) if len(prefixes) == 1 else target

        return dataclasses.replace(self, cuts=tuple(rename(c) for c in self.cuts),
                                   placements=tuple(rename(p) for p in self.placements),
                                   graphs=tuple(rename(g) for g in self.graphs))

    def check_model(self, model: nn.Module) -> None:
        """Raise :class:`PlanError` if a target names a module ``model`` lacks or a malformed run."""
        modules = dict(model.named_modules())
        for label, target in self._labelled():
            check_in_model(f"{label}.module", target.module, modules, type(model).__name__)

    # -- (de)serialisation ---------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that :meth:`from_dict` reads back to an equal plan."""
        out: dict[str, Any] = {
            "version": self.version,
            "num_streams": self.num_streams,
            "dispatch": self.dispatch,
            "whole_step_graph": self.whole_step_graph,
            "find_unused_parameters": self.find_unused_parameters,
            "cuts": [dataclasses.asdict(c) for c in self.cuts],
        }
        if self.placements:  # absent when empty: plans without placements keep their old text
            out["placements"] = [dataclasses.asdict(p) for p in self.placements]
        if self.graphs:
            out["graphs"] = [dataclasses.asdict(g) for g in self.graphs]
        if self.provenance:
            out["provenance"] = _plain_provenance(self.provenance)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> ErasePlan:
        """Build a plan from parsed YAML/JSON, refusing unknown or mistyped fields."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a mapping of fields, got {type(data).__name__}")
        _known_fields(data, {f.name for f in dataclasses.fields(cls)}, "")
        fields = dict(data)
        fields["cuts"] = _read_targets(fields.get("cuts"), "cuts", Cut, bare=True)
        fields["placements"] = _read_targets(fields.get("placements"), "placements", Placement, bare=False)
        fields["graphs"] = _read_targets(fields.get("graphs"), "graphs", Graphed, bare=True)
        if fields.get("provenance") is None:
            fields.pop("provenance", None)
        return cls(**fields)

    def dumps(self) -> str:
        """The plan as YAML text."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def loads(cls, text: str, source: str = "<plan>") -> ErasePlan:
        """Parse a plan from YAML text; errors are prefixed with ``source``."""
        data = load_yaml(text, source, PlanError)
        try:
            return cls.from_dict(data)
        except PlanError as e:
            raise PlanError(f"{one_line(source, 300)}: {e}") from None

    def save(self, path: str | Path) -> None:
        """Write the plan to ``path`` as YAML."""
        Path(path).write_text(self.dumps())

    @classmethod
    def load(cls, path: str | Path) -> ErasePlan:
        """Read a plan file; a missing, unreadable, oversized or malformed file raises :class:`PlanError`."""
        return cls.loads(read_text(path, "plan", PlanError), source=str(path))


def _items(value: Any, field: str, kind: type) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise PlanError(f"{field}: must be a list of {kind.__name__.lower()}s")
    if len(value) > MAX_TARGETS:
        raise PlanError(f"{field}: {len(value)} entries, more than the limit of {MAX_TARGETS}")
    items = tuple(value)
    for i, item in enumerate(items):
        if not isinstance(item, kind):
            raise PlanError(f"{field}[{i}]: must be a {kind.__name__}, got {type(item).__name__}")
    return items


def _field_name(key: Any) -> str:
    return key if isinstance(key, str) and _FIELD.match(key) else shown(key)


def _known_fields(data: Mapping, known: set[str], where: str) -> None:
    """Raise PlanError for the first key of ``data`` that is not a field name in ``known``."""
    for key in data:
        if not isinstance(key, str) or key not in known:
            raise PlanError(f"{where}{_field_name(key)}: unknown field (fields are: {', '.join(sorted(known))})")


def _read_targets(raw: Any, field: str, kind: type, *, bare: bool) -> tuple:
    """Cuts or placements from parsed data; ``bare``: a plain string stands for ``{module: ...}``."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise PlanError(f"{field}: must be a list of {field}")
    if len(raw) > MAX_TARGETS:
        raise PlanError(f"{field}: {len(raw)} entries, more than the limit of {MAX_TARGETS}")
    names = {f.name for f in dataclasses.fields(kind)}
    out = []
    for i, entry in enumerate(raw):
        if bare and isinstance(entry, str):
            entry = {"module": entry}
        if not isinstance(entry, Mapping):
            need = "at least 'module'" if bare else "'module' and 'stream'"
            raise PlanError(f"{field}[{i}]: must be a mapping with {need}")
        _known_fields(entry, names, f"{field}[{i}].")
        for required in ("module",) if bare else ("module", "stream"):
            if required not in entry:
                raise PlanError(f"{field}[{i}].{required}: missing")
        try:
            out.append(kind(**entry))
        except PlanError as e:
            raise PlanError(f"{field}[{i}].{e}") from None
    return tuple(out)


_WRAPPER_ATTRS = {"_dmp_wrapped_module", "module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}
"""Attribute names under which wrappers hold the module they wrap."""


def check_in_model(label: str, module: str, modules: Mapping[str, nn.Module], model_name: str) -> None:
    from torch import nn

    parent, run = _parse(module)
    if run is not None:
        name = ".".join(parent)
        container = modules.get(name)
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise PlanError(
                f"{label}: {shown(name)} is not a ModuleList or Sequential in {model_name}, "
                f"so {shown(module)} is not a run of blocks"
            )
        if run[1] > len(container):
            raise PlanError(f"{label}: run {shown(module)} ends past {shown(name)}, which has {len(container)} blocks")
    elif module not in modules:
        # A wrapper (DistributedModelParallel, DDP, FSDP, torch.compile) prefixes its module's names.
        wrapped = [n for n in modules if n.endswith("." + module)
                   and set(n[: -len(module) - 1].split(".")) <= _WRAPPER_ATTRS]
        if wrapped:
            raise PlanError(f"{label}: {model_name} has no submodule {shown(module)}; under its wrapper it is "
                            f"{', '.join(shown(n) for n in wrapped[:3])}")
        depth = module.count(".")
        near = [n for n in modules if n and n.count(".") <= depth][:12]
        raise PlanError(
            f"{label}: {model_name} has no submodule {shown(module)} (some it has: {', '.join(sorted(near))})"
        )


_SCALARS = (str, bool, int, float, type(None))


def _plain_provenance(value: Any) -> dict[str, Any]:
    """A copy of ``value`` as plain data, or PlanError naming the first entry that is not."""
    if not isinstance(value, Mapping):
        raise PlanError("provenance: must be a mapping")
    out: dict[str, Any] = {}
    for key, item in value.items():
        path = f"provenance.{_field_name(key)}"
        if not isinstance(key, str):
            raise PlanError(f"{path}: keys must be strings")
        if isinstance(item, Mapping):
            out[key] = {}
            for k, v in item.items():
                if not isinstance(k, str):
                    raise PlanError(f"{path}.{_field_name(k)}: keys must be strings")
                out[key][k] = _scalar(v, f"{path}.{_field_name(k)}")
        elif isinstance(item, (list, tuple)):
            out[key] = [_scalar(v, f"{path}[{i}]") for i, v in enumerate(item)]
        else:
            out[key] = _scalar(item, path)
    return out


def _scalar(value: Any, path: str) -> Any:
    if not isinstance(value, _SCALARS):
        raise PlanError(f"{path}: {type(value).__name__} is not allowed (provenance holds strings, numbers, "
                        "booleans and null, or one level of mapping or list of them)")
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if value.bit_length() > 63:
            raise PlanError(f"{path}: {shown(value)} is out of range for a 64-bit integer")
        return int(value)
    return float(value) if isinstance(value, float) else str(value)
