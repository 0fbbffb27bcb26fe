"""User-facing errors, and how user-given values are shown in them.

Anything a user can get wrong (a plan file, a workload name, a search space, a storage URL)
raises :class:`EraseTuneError` with one line that names the problem. The CLI prints that line
and exits with code 2; it never shows a traceback for these. A value the user gave is shown
with :func:`shown`, so a control character or a megabyte-long string in a file cannot break
the line or flood the terminal.
"""

from __future__ import annotations

import re

__all__ = ["EraseTuneError", "PlanError", "WorkloadError", "CaptureError", "Terminated", "shown", "one_line",
           "first_line"]


class EraseTuneError(Exception):
    """A problem with the user's input, described in one line."""


class PlanError(EraseTuneError, ValueError):
    """An :class:`~erase_tune.runtime.plan.ErasePlan` that is malformed or does not fit its model."""


class WorkloadError(EraseTuneError, ValueError):
    """An unknown workload, a bad workload argument, or data that cannot be read."""


class CaptureError(EraseTuneError, RuntimeError):
    """A workload that cannot be captured in a CUDA graph (dynamic shapes, CPU syncs, ...).

    After a failed capture (not after a shape mismatch at replay) the process's CUDA RNG can
    be left in capture state (seen with torch 2.11: the next ``torch.randn`` on the GPU fails
    with "Offset increment outside graph capture"): restart the process, or train without
    graphs. erase-tune's trial workers are fresh processes, so a study is not affected.
    """


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where Ctrl-C's KeyboardInterrupt would be: the command
    unwinds the same way (trials cancelled, the job marked interrupted, storage left
    consistent) and the CLI exits with 128 + the signal's number, as a shell reports it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


def one_line(text: object, limit: int | None = None, *, squeeze: bool = False) -> str:
    """``text`` (``str()`` of it) on one line, the one helper every one-line error goes through:
    with ``squeeze``, every run of white space (newlines included) becomes one space, as for a
    message (an exception's, a driver's); then every non-printable character left (newline,
    tab, escape, ...) is escaped, as for a value the user typed; cut to at most ``limit``
    characters when given."""
    if isinstance(text, BaseException) and not str(text).strip():
        text = type(text).__name__  # an exception with no message: its type says what it was
    text = " ".join(str(text).split()) if squeeze else str(text)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message: one line, at most ``limit`` characters."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"  # repr() of a huge int can raise
    try:
        text = one_line(repr(value))
    except Exception:  # noqa: BLE001 (a user object's own __repr__ may raise anything)
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def first_line(e: BaseException, limit: int = 300) -> str:
    """An exception's first non-empty line (its type's name if it has none), for a one-line
    error; terminal colour codes (Ray colours its errors) are dropped, the rest made printable."""
    lines = [line for line in _ANSI.sub("", str(e)).strip().splitlines() if line.strip()]
    return one_line(lines[0] if lines else type(e).__name__)[:limit]


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
