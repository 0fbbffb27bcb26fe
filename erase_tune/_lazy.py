"""Names a package exports but imports on first use (PEP 562): what needs torch, so that reading
a stored study (``erase-tune status``, ``report``, ``db``) never loads it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A ``__getattr__`` for ``package``: ``where[name]`` is the submodule that defines ``name``.
    A name is looked up once; the package keeps it from then on."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
