"""The ERASE plan: where to cut a model, on which stream, how to dispatch, what to graph.

A plan is what `erase-tune export` writes and production training loads. It is a frozen,
versioned, validated dataclass; YAML is read with ``yaml.safe_load`` only, so loading a plan
never executes code from the file. Every error names the field (and the file) at fault.

A cut target is either a dotted submodule name (``subarchs.0``) or a run of consecutive
blocks of a ``ModuleList``/``Sequential`` written ``blocks.2:5`` (blocks 2, 3 and 4, which
the parent must call as a chain: each block on the previous block's output).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from torch import nn

from erase_tune._files import load_yaml, read_text
from erase_tune.errors import PlanError

__all__ = ["PLAN_VERSION", "DISPATCH_MODES", "Cut", "ErasePlan"]

PLAN_VERSION = 1
DISPATCH_MODES = ("blocking", "threaded", "deferred")
"""``blocking``: the main thread launches each cut's backward right after its forward.
``threaded``: a worker thread launches it, so the main thread keeps dispatching forward work.
``deferred``: no early launch; aux losses join the main loss in one backward at the end
(the "detach only" twin of a plan: same work removed, no overlap)."""

_RUN = re.compile(r"^(?P<parent>[A-Za-z_][\w.]*)\.(?P<start>\d+):(?P<stop>\d+)$")
_NAME = re.compile(r"^[A-Za-z_0-9][\w]*(\.[\w]+)*$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cut:
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
        if not isinstance(self.module, str) or not self.module:
            raise PlanError("module: must be a non-empty string")
        if not (_RUN.match(self.module) or _NAME.match(self.module)):
            raise PlanError(f"module: {self.module!r} is neither a dotted module name nor a run 'parent.start:stop'")
        run = _RUN.match(self.module)
        if run and int(run["start"]) >= int(run["stop"]):
            raise PlanError(f"module: run {self.module!r} is empty (start must be < stop)")
        if isinstance(self.stream, bool) or not isinstance(self.stream, int) or self.stream < 0:
            raise PlanError(f"stream: {self.stream!r} must be an integer >= 0")
        if isinstance(self.aux_weight, bool) or not isinstance(self.aux_weight, (int, float)):
            raise PlanError(f"aux_weight: {self.aux_weight!r} must be a number")
        if not math.isfinite(self.aux_weight) or self.aux_weight <= 0:
            raise PlanError(f"aux_weight: {self.aux_weight!r} must be a finite number > 0")
        object.__setattr__(self, "aux_weight", float(self.aux_weight))
        if not isinstance(self.graph, bool):
            raise PlanError(f"graph: {self.graph!r} must be true or false")

    @property
    def name(self) -> str:
        """The cut's name: its module target, as written."""
        return self.module

    @property
    def members(self) -> tuple[str, ...]:
        """The submodule names this cut covers, in call order."""
        run = _RUN.match(self.module)
        if not run:
            return (self.module,)
        return tuple(f"{run['parent']}.{i}" for i in range(int(run["start"]), int(run["stop"])))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ErasePlan:
    """Where and how ERASE detaches a model. A plan with no cuts is plain training."""

    cuts: tuple[Cut, ...] = ()
    """The detached pieces, in any order; no two may overlap."""
    num_streams: int = 0
    """Number of side CUDA streams the cuts may use (0: everything on the main stream)."""
    dispatch: str = "blocking"
    """Who launches early backward: ``blocking``, ``threaded`` or ``deferred`` (see DISPATCH_MODES)."""
    whole_step_graph: bool = False
    """Capture the whole step (forward, early backwards, main backward, optimizer) as one
    CUDA graph. Launch order is then fixed at capture, so dispatch and per-cut graph flags
    have no effect (capture always runs blocking)."""
    find_unused_parameters: bool = False
    """DDP's find_unused_parameters, for multi-GPU trials."""
    version: int = PLAN_VERSION
    """Plan file format version."""
    provenance: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Where the plan came from (study, trial, measured gain, device, versions); informational."""

    def __post_init__(self) -> None:
        if self.version != PLAN_VERSION:
            raise PlanError(f"version: {self.version!r} is not supported (this erase-tune reads version {PLAN_VERSION})")
        cuts = self.cuts
        if isinstance(cuts, (str, bytes)) or not isinstance(cuts, Sequence):
            raise PlanError("cuts: must be a list of cuts")
        cuts = tuple(cuts)
        for i, cut in enumerate(cuts):
            if not isinstance(cut, Cut):
                raise PlanError(f"cuts[{i}]: must be a Cut, got {type(cut).__name__}")
        object.__setattr__(self, "cuts", cuts)
        if isinstance(self.num_streams, bool) or not isinstance(self.num_streams, int) or self.num_streams < 0:
            raise PlanError(f"num_streams: {self.num_streams!r} must be an integer >= 0")
        if self.dispatch not in DISPATCH_MODES:
            raise PlanError(f"dispatch: {self.dispatch!r} is not one of {', '.join(DISPATCH_MODES)}")
        for name in ("whole_step_graph", "find_unused_parameters"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name}: {getattr(self, name)!r} must be true or false")
        if not isinstance(self.provenance, Mapping):
            raise PlanError("provenance: must be a mapping")
        object.__setattr__(self, "provenance", dict(self.provenance))
        owner: dict[str, int] = {}
        for i, cut in enumerate(cuts):
            if cut.graph and self.dispatch == "deferred":
                raise PlanError(
                    f"cuts[{i}].graph: a per-cut graph captures the cut's backward with its forward, "
                    "so it cannot be deferred (dispatch: deferred)"
                )
            if cut.stream > self.num_streams:
                raise PlanError(
                    f"cuts[{i}].stream: {cut.stream} is out of range 0..{self.num_streams} (num_streams={self.num_streams})"
                )
            for member in cut.members:
                for other, j in owner.items():
                    if member == other or member.startswith(other + ".") or other.startswith(member + "."):
                        raise PlanError(f"cuts[{i}].module: {cut.module!r} overlaps cuts[{j}].module {cuts[j].module!r}")
            for member in cut.members:
                owner[member] = i

    # -- derived plans ---------------------------------------------------------------------

    def detach_only(self) -> ErasePlan:
        """The same cuts and aux heads with no early launch: one stream, one backward at the end."""
        cuts = tuple(dataclasses.replace(c, stream=0, graph=False) for c in self.cuts)
        return dataclasses.replace(self, cuts=cuts, num_streams=0, dispatch="deferred")

    def without_cuts(self) -> ErasePlan:
        """This plan's execution settings (e.g. whole-step graph) with nothing detached."""
        return dataclasses.replace(self, cuts=(), num_streams=0, dispatch="blocking")

    def canonical(self) -> ErasePlan:
        """One representative of the plans that run identically.

        Side-stream ids are renumbered by first use in cut order and unused streams dropped
        (stream ids are interchangeable); with a whole-step graph, dispatch and per-cut graph
        flags are reset since they have no effect there; cuts are sorted by target.
        """
        cuts = sorted(self.cuts, key=lambda c: c.module)
        remap: dict[int, int] = {}
        for c in cuts:
            if c.stream and c.stream not in remap:
                remap[c.stream] = len(remap) + 1
        graph_ok = not self.whole_step_graph
        cuts = tuple(
            dataclasses.replace(c, stream=remap.get(c.stream, 0), graph=c.graph and graph_ok) for c in cuts
        )
        dispatch = "blocking" if self.whole_step_graph and self.dispatch != "deferred" else self.dispatch
        if not cuts:
            dispatch = "blocking"
        return dataclasses.replace(self, cuts=cuts, num_streams=len(remap), dispatch=dispatch)

    def describe(self) -> str:
        """A one-line summary for tables and logs."""
        if not self.cuts:
            what = "no cuts"
        else:
            what = ", ".join(f"{c.module}@s{c.stream}{'+g' if c.graph else ''}" for c in self.cuts)
        graph = ", whole-step graph" if self.whole_step_graph else ""
        return f"{what}; {self.num_streams} side stream(s), {self.dispatch}{graph}"

    # -- checks against a model --------------------------------------------------------------

    def check_model(self, model: nn.Module) -> None:
        """Raise :class:`PlanError` if a cut names a module ``model`` lacks or a malformed run."""
        modules = dict(model.named_modules())
        for i, cut in enumerate(self.cuts):
            run = _RUN.match(cut.module)
            if run:
                parent = modules.get(run["parent"])
                if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
                    raise PlanError(
                        f"cuts[{i}].module: {run['parent']!r} is not a ModuleList or Sequential in "
                        f"{type(model).__name__}, so {cut.module!r} is not a run of blocks"
                    )
                if int(run["stop"]) > len(parent):
                    raise PlanError(
                        f"cuts[{i}].module: run {cut.module!r} ends past {run['parent']!r}, which has {len(parent)} blocks"
                    )
            elif cut.module not in modules:
                near = sorted(n for n in modules if n and n.count(".") <= cut.module.count("."))[:12]
                raise PlanError(
                    f"cuts[{i}].module: {type(model).__name__} has no submodule {cut.module!r}"
                    f" (some it has: {', '.join(near)})"
                )

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
        if self.provenance:
            out["provenance"] = _plain(self.provenance)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> ErasePlan:
        """Build a plan from parsed YAML/JSON, refusing unknown or mistyped fields."""
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a mapping of fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"{unknown[0]}: unknown field (fields are: {', '.join(sorted(known))})")
        fields = dict(data)
        raw_cuts = fields.get("cuts", [])
        if raw_cuts is None:
            raw_cuts = []
        if not isinstance(raw_cuts, list):
            raise PlanError("cuts: must be a list of cuts")
        cut_fields = {f.name for f in dataclasses.fields(Cut)}
        cuts = []
        for i, raw in enumerate(raw_cuts):
            if isinstance(raw, str):
                raw = {"module": raw}
            if not isinstance(raw, Mapping):
                raise PlanError(f"cuts[{i}]: must be a mapping with at least 'module'")
            bad = sorted(set(raw) - cut_fields)
            if bad:
                raise PlanError(f"cuts[{i}].{bad[0]}: unknown field (fields are: {', '.join(sorted(cut_fields))})")
            if "module" not in raw:
                raise PlanError(f"cuts[{i}].module: missing")
            try:
                cuts.append(Cut(**raw))
            except PlanError as e:
                raise PlanError(f"cuts[{i}].{e}") from None
        fields["cuts"] = tuple(cuts)
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
            raise PlanError(f"{source}: {e}") from None

    def save(self, path: str | Path) -> None:
        """Write the plan to ``path`` as YAML."""
        Path(path).write_text(self.dumps())

    @classmethod
    def load(cls, path: str | Path) -> ErasePlan:
        """Read a plan file; a missing, unreadable or malformed file raises :class:`PlanError`."""
        return cls.loads(read_text(path, "plan", PlanError), source=str(path))


def _plain(value: Any) -> Any:
    """Mappings and sequences as plain dicts and lists, for YAML."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
