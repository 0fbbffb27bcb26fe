"""The erase_tune log's lines as a test reads them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _Lines(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def erase_tune_lines(level: int = logging.INFO) -> Iterator[list[str]]:
    """The messages the ``erase_tune`` logger emits at ``level`` or above while the block runs,
    through a handler of its own: a CLI run earlier in this process may have turned the logger's
    propagation off, which pytest's caplog relies on."""
    logger, seen = logging.getLogger("erase_tune"), _Lines(level)
    before = logger.level
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    logger.addHandler(seen)
    try:
        yield seen.lines
    finally:
        logger.removeHandler(seen)
        logger.setLevel(before)
