"""Reading the user's YAML files (plans, search spaces) with one-line errors.

Only ``yaml.safe_load``: loading a file never executes code from it. A file is a few
kilobytes of settings, so anything far larger or deeper is refused before it can cost
memory or time: files over :data:`MAX_FILE_BYTES`, nesting deeper than :data:`MAX_DEPTH`
(a recursive alias is infinitely deep), more than :data:`MAX_VALUES` values (aliases can
repeat a subtree exponentially often), integers too long to convert. Mapping keys must be
strings. Every error names the file and fits on one line.

Nesting is refused while the file is parsed, not after: PyYAML's scanner looks up to 1024
characters ahead for a possible key at every open bracket, so a file of nothing but ``[``
cost about a second before Python's recursion limit stopped it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from erase_tune.errors import EraseTuneError, one_line, shown

__all__ = ["MAX_FILE_BYTES", "MAX_DEPTH", "MAX_VALUES", "read_text", "load_yaml"]

MAX_FILE_BYTES = 1 << 20
"""Largest plan or search-space file read (1 MiB)."""
MAX_DEPTH = 32
"""Deepest nesting of mappings and lists accepted in a file."""
MAX_VALUES = 100_000
"""Most values (scalars, mappings, lists, with aliases counted each time they are used)."""


def read_text(path: str | Path, what: str, error: type[EraseTuneError]) -> str:
    """The file's text, or ``error("<path>: <what> file not found")`` and the like."""
    p = Path(path)
    name = one_line(str(p), 300)
    try:
        # Non-blocking: opening a FIFO would otherwise wait forever for a writer.
        with os.fdopen(os.open(p, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)  # bounded: /dev/zero must not hang us either
    except FileNotFoundError:
        raise error(f"{name}: {what} file not found") from None
    except ValueError:  # a NUL byte in the path: no file can have that name
        raise error(f"{name}: not a file name (it holds a NUL character)") from None
    except OSError as e:
        raise error(f"{name}: cannot read {what} file: {one_line(e.strerror or str(e))}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise error(f"{name}: {what} file is larger than {MAX_FILE_BYTES // 1024} KiB; it should be a small YAML file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{name}: cannot read {what} file: not UTF-8 text (byte {e.start})") from None


def load_yaml(text: str, source: str, error: type[EraseTuneError]) -> Any:
    """Parse YAML safely; a syntax error becomes ``error("<source>: not valid YAML at line N: ...")``."""
    source = one_line(source, 300)
    if len(text) > MAX_FILE_BYTES:
        raise error(f"{source}: more than {MAX_FILE_BYTES // 1024} KiB of YAML; it should be a small file")
    try:
        data = yaml.load(text, Loader=_Loader)  # a SafeLoader, with a depth bound
    except _TooDeep:
        raise error(f"{source}: not valid YAML: nested more than {MAX_DEPTH} levels deep") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{source}: not valid YAML{where}: {one_line(problem)}") from None
    except RecursionError:
        raise error(f"{source}: not valid YAML: nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits
        raise error(f"{source}: not valid YAML: a value cannot be read ({one_line(str(e).splitlines()[0])})") from None
    _check_shape(data, source, error)
    return data


class _TooDeep(Exception):
    """Raised by :class:`_Loader` past the nesting :func:`_check_shape` allows."""


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that stops composing past the nesting :func:`_check_shape` allows
    (the document's root is at depth 1, a value inside MAX_DEPTH containers at MAX_DEPTH + 1)."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH + 1:
                raise _TooDeep
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _check_shape(data: Any, source: str, error: type[EraseTuneError]) -> None:
    """Refuse nesting deeper than MAX_DEPTH, more than MAX_VALUES values, non-string keys."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    count = 1
    while stack:
        value, path, depth = stack.pop()
        if not isinstance(value, (Mapping, list)):
            continue
        if depth >= MAX_DEPTH:
            raise error(f"{source}: {_bounded(path) or 'the file'} is nested more than {MAX_DEPTH} levels deep "
                        "(a recursive alias?)")
        count += len(value)
        if count > MAX_VALUES:  # checked before pushing, so the stack stays small too
            raise error(f"{source}: more than {MAX_VALUES} values (aliases count each time they are used)")
        if isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
            continue
        for key, v in value.items():
            if not isinstance(key, str):
                where = _bounded(path) or "the top level"
                raise error(f"{source}: {where} has the key {shown(key)}: keys must be strings")
            stack.append((v, f"{path}.{_key(key)}" if path else _key(key), depth + 1))


def _bounded(path: str, limit: int = 200) -> str:
    """A path in the file for a message: 32 levels of 40-character keys would be a screenful."""
    return path if len(path) <= limit else path[: limit - 1] + "…"


def _key(key: str) -> str:
    """A mapping key as a path component: one line, bounded."""
    return one_line(key) if len(key) <= 40 else one_line(key[:39]) + "…"
