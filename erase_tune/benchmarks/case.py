"""A benchmark case: a registered function with its own typed options and one output format.

A case declares its options as a dataclass (fields made with :func:`opt`); the runner builds the
case's command-line options from it (``--window-steps`` for ``window_steps``), calls the function
with the parsed dataclass and a :class:`Context`, and writes what it returns to ``DIR/CASE.json``
with the measurement's provenance (:func:`erase_tune.measure.provenance`). A result's ``"table"``
(text) is printed last. Cases import the tuning service (Optuna, Ray, SQLAlchemy) only inside
their function, never at module import time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

__all__ = ["CASES", "ROOT", "Case", "CaseError", "Context", "case", "opt"]

ROOT = Path(__file__).resolve().parents[2]
"""The checkout the benchmarks run from (search_spaces/, docs/results/, tests/)."""

Cuda = Literal["no", "optional", "required"]


def opt(default: Any = None, help: str = "", *, choices: tuple[str, ...] | None = None) -> Any:
    """One option of a case: its default and one line of help. A list default is an appended
    option (``--arg a --arg b``); a bool defaulting to False is a flag."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass
class Context:
    """What a case gets besides its options: where to write, under which name."""

    out: Path
    name: str
    argv: list[str]
    rc: int = 0  # a case sets it non-zero to fail the run after its result is written
    started: dict[str, Any] = dataclasses.field(default_factory=dict)
    _save: Callable[[dict[str, Any], bool], None] | None = None

    def path(self, suffix: str) -> Path:
        """``DIR/NAME<suffix>``: a file of this case beside its JSON result."""
        return self.out / f"{self.name}{suffix}"

    def save(self, result: dict[str, Any]) -> None:
        """Write a partial result now (``complete: false``), so a time limit keeps what was measured."""
        if self._save is not None:
            self._save(result, False)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    description: str
    figures: tuple[str, ...]
    options: type
    fn: Callable[[Any, Context], dict[str, Any]]
    cuda: Cuda = "no"
    gpus: int = 1
    recorded_with: str | None = None  # the script it was before issue 28 (historical provenance)

    def needs(self) -> str:
        if self.cuda == "required":
            return "needs CUDA" + (f" ({self.gpus} GPUs)" if self.gpus > 1 else "")
        if self.cuda == "optional":
            return "CUDA or CPU" + (f" ({self.gpus} GPUs on CUDA)" if self.gpus > 1 else "")
        return "CPU"

    def add_arguments(self, parser: Any) -> None:
        hints = typing.get_type_hints(self.options)
        for f in dataclasses.fields(self.options):
            flag = "--" + f.name.replace("_", "-")
            kind = hints[f.name]
            help_ = f.metadata.get("help", "").replace("%", "%%")  # argparse formats help with %
            choices = f.metadata.get("choices")
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if kind is bool:
                parser.add_argument(flag, dest=f.name, action="store_true" if not default else "store_false",
                                    default=default, help=help_)
            elif isinstance(default, list):
                parser.add_argument(flag, dest=f.name, action="append", default=None, metavar="VALUE",
                                    help=help_ + " (repeatable)")
            else:
                base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
                parser.add_argument(flag, dest=f.name, type=base, default=default, choices=choices,
                                    help=f"{help_} (default {default})")

    def parse(self, ns: dict[str, Any]) -> Any:
        values = {}
        for f in dataclasses.fields(self.options):
            v = ns.get(f.name)
            if v is None and f.default_factory is not dataclasses.MISSING:
                v = f.default_factory()
            values[f.name] = v
        return self.options(**values)


CASES: dict[str, Case] = {}


def case(name: str, options: type, *, description: str, figures: tuple[str, ...], cuda: Cuda = "no",
         gpus: int = 1, recorded_with: str | None = None) -> Callable:
    """Register ``fn(options, ctx) -> result`` as the case ``name``."""

    def register(fn: Callable[[Any, Context], dict[str, Any]]) -> Callable:
        if name in CASES:
            raise ValueError(f"benchmark case {name!r} registered twice")
        CASES[name] = Case(name, description, figures, options, fn, cuda, gpus, recorded_with)
        return fn

    return register


def dump(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (a time limit mid-write leaves the previous file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


class CaseError(Exception):
    """A case cannot run as asked: the runner prints the message on one line and exits 2."""
