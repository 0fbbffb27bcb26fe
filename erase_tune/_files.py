"""Reading the user's YAML files (plans, search spaces) with one-line errors.

Only ``yaml.safe_load``: loading a file never executes code from it. Every error names the
file and, for syntax errors, the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from erase_tune.errors import EraseTuneError

__all__ = ["read_text", "load_yaml"]


def read_text(path: str | Path, what: str, error: type[EraseTuneError]) -> str:
    """The file's text, or ``error("<path>: <what> file not found")`` and the like."""
    p = Path(path)
    try:
        return p.read_text()
    except FileNotFoundError:
        raise error(f"{p}: {what} file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{p}: cannot read {what} file: {e}") from None


def load_yaml(text: str, source: str, error: type[EraseTuneError]) -> Any:
    """Parse YAML safely; a syntax error becomes ``error("<source>: not valid YAML at line N: ...")``."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise error(f"{source}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
