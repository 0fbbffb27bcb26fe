"""Environment variables erase-tune reads, parsed like command-line arguments.

A setting in the environment is as much the user's input as an option: a value that does not
parse is one line naming the variable (the CLI exits 2), never a ``ValueError`` traceback from
deep inside a command, and never a silent fallback to the default. The CLI checks every one of
them before a command starts (:func:`check_environment`), so a typo fails at once rather than
when the storage is first lost an hour into a job; the library reads them through the same
functions. An empty value means "not set", as shells use it.
"""

from __future__ import annotations

import math
import os

from erase_tune.errors import EraseTuneError, one_line

__all__ = ["STORAGE_ENV", "RETRY_ENV", "JOURNAL_ENV", "UPLOAD_ENV", "RAY_ENV", "STOP_ENV", "MAX_RETRY_S",
           "STOP_LIMIT_S", "env_text", "env_seconds", "env_mebibytes", "env_stop_limit_s", "check_environment"]

STORAGE_ENV = "ERASE_TUNE_STORAGE"
RETRY_ENV = "ERASE_TUNE_STORAGE_RETRY_S"
JOURNAL_ENV = "ERASE_TUNE_JOURNAL_DIR"
UPLOAD_ENV = "ERASE_TUNE_MAX_UPLOAD_MB"
RAY_ENV = "RAY_ADDRESS"
STOP_ENV = "ERASE_TUNE_STOP_LIMIT_S"
MAX_RETRY_S = 7 * 86400.0
"""Longest storage retry window accepted (a week: longer is a typo, not a plan)."""
MAX_UPLOAD_MB = 1 << 20
"""Largest upload limit accepted (1 TiB in MiB)."""
STOP_LIMIT_S = 25.0
"""How long after the first signal a command may take to stop before its process is ended
(``$ERASE_TUNE_STOP_LIMIT_S``, erase_tune._signals): its clean-up (trials cancelled, the job marked
interrupted, Ray released: at most 15 s of it) is cut short, as by ``kill -9``, which a resumed
job recovers from. Under the 30 s Kubernetes and systemd give before their SIGKILL, so the command
still says why it ended."""
MAX_STOP_S = 86400.0


def _shown(value: str) -> str:
    return repr(one_line(value, 60))


def env_text(name: str) -> str | None:
    """The variable's value, None when unset or empty; white space around it or control
    characters in it are refused (they are never part of a URL, address or path meant)."""
    value = os.environ.get(name)
    if not value:
        return None
    if value != value.strip():
        raise EraseTuneError(f"${name}: {_shown(value)} has white space around it; remove it (or unset {name})")
    if not value.isprintable():
        raise EraseTuneError(f"${name}: {_shown(value)} holds a control character")
    return value


def _number(name: str, unit: str, low: float, high: float) -> float | None:
    value = env_text(name)
    if value is None:
        return None
    try:
        number = float(value.replace("_", ""))
    except ValueError:
        raise EraseTuneError(f"${name}: {_shown(value)} is not a number of {unit}") from None
    if not math.isfinite(number) or not low <= number <= high:
        raise EraseTuneError(f"${name}: {_shown(value)} must be a number of {unit} in {low:g}..{high:g}")
    return number


def env_seconds(name: str, default: float, high: float = MAX_RETRY_S) -> float:
    """A duration in seconds from ``name`` (0..``high``), else ``default``."""
    number = _number(name, "seconds", 0.0, high)
    return default if number is None else number


def env_mebibytes(name: str, default: float) -> float:
    """A size in MiB from ``name`` (> 0), else ``default``."""
    number = _number(name, "MiB", 1e-6, MAX_UPLOAD_MB)
    return default if number is None else number


def env_stop_limit_s() -> float:
    """``$ERASE_TUNE_STOP_LIMIT_S`` (0 to a day), else :data:`STOP_LIMIT_S`."""
    return env_seconds(STOP_ENV, STOP_LIMIT_S, high=MAX_STOP_S)


def check_environment() -> None:
    """Parse every variable erase-tune reads; the first that does not parse raises, naming it."""
    env_text(STORAGE_ENV)  # its URL is parsed where --storage is: the same message for both
    env_seconds(RETRY_ENV, 60.0)
    env_mebibytes(UPLOAD_ENV, 1.0)
    env_text(RAY_ENV)
    env_stop_limit_s()
    journal = env_text(JOURNAL_ENV)
    if journal is not None and os.path.exists(journal) and not os.path.isdir(journal):
        raise EraseTuneError(f"${JOURNAL_ENV}: {_shown(journal)} exists and is not a directory")
