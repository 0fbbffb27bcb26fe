"""Workloads by name: the built-in proxies and a user's own factory by import path.

``get_workload("ctr", {"batch": 8192})`` builds a built-in; ``get_workload("pkg.mod:make",
{...})`` imports ``pkg.mod`` and calls ``make(**args)``. Arguments are checked against the
factory's signature before it runs (unknown names, wrong types), so a typo in a search
space or on the command line fails at once with one line naming it, not after a trial has
been scheduled on a GPU. Built-in modules are imported on first use only, and so is torch
(:mod:`~erase_tune.workloads.base`, the workload records): reading a workload's limits or its
name in a stored study needs neither.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from erase_tune._lazy import lazy_names
from erase_tune.errors import EraseTuneError, WorkloadError, one_line, shown

if TYPE_CHECKING:
    import torch

    from erase_tune.workloads.base import Batch, Task, Workload, WorkloadData

__all__ = ["BUILTINS", "Batch", "Task", "Workload", "WorkloadData", "get_workload", "module_of", "workload_args"]

BUILTINS = ("ctr", "gpt", "mlp", "dlrm", "deepfm")
"""Built-in workloads; each is ``erase_tune.workloads.<name>.workload``."""

_MISSING = inspect.Parameter.empty


def get_workload(name: str, args: Mapping[str, Any] | None = None) -> Workload:
    """Build the workload ``name`` (a built-in or ``package.module:factory``) with ``args``.

    Raises :class:`WorkloadError` (one line) for an unknown name, a module that does not
    import, an argument the factory does not take or of the wrong type, a factory that
    fails, or one that returns something other than a :class:`Workload`.
    """
    if not isinstance(name, str) or not name.strip():
        raise WorkloadError(f"workload name must be a non-empty string, got {shown(name)}")
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise WorkloadError(f"workload {shown(name)}: arguments must be a mapping, got {type(args).__name__}")
    factory = _resolve(name)
    call_args = _check_args(name, factory, args)
    try:
        result = factory(**call_args)
    except WorkloadError as exc:
        message = one_line(exc, 300, squeeze=True)
        if message.startswith("workload "):
            raise
        raise WorkloadError(f"workload {shown(name)}: {message}") from exc
    except Exception as exc:
        why = one_line(exc, 300, squeeze=True)
        raise WorkloadError(f"workload {shown(name)}: factory failed: {type(exc).__name__}: {why}") from exc
    except SystemExit as exc:  # e.g. builtins:exit: the command would end "successfully" having done nothing
        code = one_line(exc, 300, squeeze=True)
        raise WorkloadError(f"workload {shown(name)}: the factory exited the program (SystemExit {code}): "
                            "it is not a workload factory") from None
    from erase_tune.workloads.base import Workload

    if not isinstance(result, Workload):
        raise WorkloadError(
            f"workload {shown(name)}: factory returned {type(result).__name__}, expected erase_tune.workloads.Workload"
        )
    if name not in BUILTINS:
        # Provenance: record the name the user gave and, if the factory left them out, the
        # arguments it ran with (defaults included).
        recorded = dict(result.args) or _resolved(factory, call_args)
        result = dataclasses.replace(result, name=name, args=recorded)
    return result


def module_of(name: str) -> str:
    """The module a workload's code lives in: ``erase_tune.workloads.<name>`` for a built-in,
    the module part of ``package.module:factory`` otherwise."""
    return name.partition(":")[0] if ":" in name else f"erase_tune.workloads.{name}"


def fused_if_cuda(cls: type[torch.optim.Optimizer], params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """``cls(params, fused=True, **kwargs)`` when every parameter is on CUDA (the fused
    Adam kernels are CUDA-only and one step cheaper to launch), else the default kernel.
    ``params`` may be tensors or param-group dicts, as for any optimizer."""
    groups = [dict(p, params=list(p["params"])) if isinstance(p, dict) else p for p in params]
    tensors = [t for g in groups for t in (g["params"] if isinstance(g, dict) else [g])]
    fused = bool(tensors) and all(t.is_cuda for t in tensors)
    return cls(groups, fused=fused, **kwargs)


# ---------------------------------------------------------------------------------------
# Resolution and argument checks
# ---------------------------------------------------------------------------------------


def _resolve(name: str) -> Callable[..., Any]:
    if name in BUILTINS:
        return importlib.import_module(f"{__name__}.{name}").workload
    if ":" not in name:
        raise WorkloadError(
            f"unknown workload {shown(name)} (built-ins: {', '.join(BUILTINS)}; or a factory 'package.module:function')"
        )
    module_name, _, attr = name.partition(":")
    dotted = lambda s: bool(s) and all(part.isidentifier() for part in s.split("."))  # noqa: E731
    if not (dotted(module_name) and dotted(attr)):
        raise WorkloadError(f"workload {shown(name)}: not of the form 'package.module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # a user module can fail to import in any way (SyntaxError, ...)
        raise WorkloadError(
            f"workload {shown(name)}: cannot import module {shown(module_name)} "
            f"({type(exc).__name__}: {one_line(exc, 300, squeeze=True)})"
        ) from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise WorkloadError(f"workload {shown(name)}: module {shown(module_name)} has no attribute {shown(attr)}")
        target = getattr(target, part)
    if not callable(target):
        raise WorkloadError(
            f"workload {shown(name)}: {shown(attr)} is a {type(target).__name__}, not a callable factory"
        )
    if module_name == "builtins" or inspect.isbuiltin(target) or \
            getattr(target, "__module__", None) in ("builtins", "_sitebuiltins"):
        # os:abort, builtins:exit, builtins:print: C functions and the interpreter's own
        # helpers, which can end the process instead of returning a Workload (by the module's
        # name too: a library may have replaced builtins.print by a Python function, as Ray does).
        raise WorkloadError(f"workload {shown(name)}: {shown(attr)} is built into Python ({type(target).__name__}), "
                            "not a workload factory (a Python function returning erase_tune.workloads.Workload)")
    return target


def _check_args(name: str, factory: Callable[..., Any], args: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments to call ``factory`` with: names and types checked, ints widened to float
    where the factory takes a float."""
    for key in args:
        if not isinstance(key, str):
            raise WorkloadError(f"workload {shown(name)}: argument names must be strings, got {shown(key)}")
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # e.g. some builtins and C extensions: nothing to check against
        return dict(args)
    by_keyword = {
        p.name: p for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    unknown = [key for key in args if key not in by_keyword]
    if unknown and not takes_any:
        listed = ", ".join(by_keyword) or "none"
        plural = "s" if len(unknown) > 1 else ""
        raise WorkloadError(
            f"workload {shown(name)}: unknown argument{plural} {', '.join(map(shown, unknown))} (arguments: {listed})"
        )
    missing = [p.name for p in params.values() if p.default is _MISSING and p.kind in (p.POSITIONAL_OR_KEYWORD,
               p.KEYWORD_ONLY) and p.name not in args]  # fmt: skip
    if missing:
        raise WorkloadError(f"workload {shown(name)}: missing argument {shown(missing[0])}")
    try:
        hints = typing.get_type_hints(factory)
    except Exception:  # unresolvable annotations: fall back to each default's type
        hints = {}
    out = dict(args)
    for key, value in args.items():
        param = by_keyword.get(key)
        if param is None:
            continue
        expected: Any = hints.get(key, _MISSING)
        if expected is _MISSING and param.default is not _MISSING and param.default is not None:
            expected = type(param.default)
        if expected is _MISSING or _matches(value, expected) is not False:
            if _is_float(expected) and isinstance(value, int) and not isinstance(value, bool):
                try:
                    out[key] = float(value)
                except OverflowError:  # past 1.8e308: no float holds it
                    raise WorkloadError(f"workload {shown(name)}: argument {shown(key)} must be a float, got "
                                        f"{shown(value)}, too large for one") from None
            continue
        raise WorkloadError(
            f"workload {shown(name)}: argument {shown(key)} must be {_describe(expected)}, "
            f"got {type(value).__name__} {shown(value)}"
        )
    return out


def _is_float(hint: Any) -> bool:
    """A float parameter (possibly optional) that does not also take ints as they are."""
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return float in members and int not in members


def _matches(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` fits the annotation ``hint``; None when the hint is beyond this check."""
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        verdicts = [_matches(value, member) for member in typing.get_args(hint)]
        return True if any(verdicts) else (None if None in verdicts else False)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is os.PathLike or origin is os.PathLike:
        return isinstance(value, os.PathLike)
    if origin is not None and isinstance(origin, type):
        return isinstance(value, origin)  # list[int], Mapping[str, Any], ...: check the container only
    if isinstance(hint, type):
        return isinstance(value, hint)
    return None


def _describe(hint: Any) -> str:
    if hint is type(None) or hint is None:
        return "None"
    if isinstance(hint, type) and typing.get_origin(hint) is None:
        return hint.__name__
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_describe(member) for member in typing.get_args(hint))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if isinstance(origin, type):
        return origin.__name__  # list[int] → list: the check covers the container only
    return str(hint).replace("typing.", "")


def _resolved(factory: Callable[..., Any], args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` plus the defaults of the parameters not given (keyword parameters only)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return dict(args)
    defaults = {p.name: p.default for p in params if p.default is not _MISSING and p.kind is not p.POSITIONAL_ONLY}
    return {**defaults, **args}


def workload_args(pairs: Iterable[str]) -> dict[str, Any]:
    """``--arg KEY=VALUE`` pairs as a workload's arguments: each value read as YAML (``4096`` an
    int, ``1e-3`` a float, ``512-256-128`` a string), kept as text where YAML cannot read it; bounded
    as a YAML file is (:func:`erase_tune._files.load_arg`)."""
    from erase_tune._files import load_arg

    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise EraseTuneError(f"--arg: {shown(pair)} is not KEY=VALUE")
        args[key] = load_arg(value, f"--arg {key}", WorkloadError) if value else ""
    return args


__getattr__ = lazy_names(__name__, dict.fromkeys(("Batch", "Task", "Workload", "WorkloadData"), "base"))
