"""A local write-ahead journal of trial outcomes, so a lost storage loses no measurement.

The driver writes each outcome here *before* telling the study, and deletes it once the
study and erase-tune's tables hold it. If the storage goes away in between (a dropped
database, a read-only SQLite file), the outcome stays on local disk and the next ``start``
of the same study on the same storage replays it before anything else.

One directory per (storage, study) under ``$ERASE_TUNE_JOURNAL_DIR`` (default
``~/.local/state/erase-tune/journal``); one pickle file per trial, written atomically. The
files are this user's own, written by this program, so reading them back is as trusted as
any of the user's files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import tempfile
from pathlib import Path

from erase_tune._env import env_text
from erase_tune.errors import EraseTuneError, one_line
from erase_tune.tune.execute.outcome import TrialOutcome

__all__ = ["JOURNAL_ENV", "Entry", "Journal", "journal_root", "check_journal"]

JOURNAL_ENV = "ERASE_TUNE_JOURNAL_DIR"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """An outcome not yet known to be stored, with what recording it needs."""

    trial_number: int
    plan_key: str
    attempts: int
    outcome: TrialOutcome


def journal_root() -> Path:
    """``$ERASE_TUNE_JOURNAL_DIR``, else ``~/.local/state/erase-tune/journal``."""
    return Path(env_text(JOURNAL_ENV) or Path.home() / ".local" / "state" / "erase-tune" / "journal")


def check_journal() -> None:
    """The journal must be writable, which a job checks when it starts: a trial's outcome that
    has nowhere to go ended the job in a traceback once the trial was measured."""
    root = journal_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=".tmp-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise EraseTuneError(f"${JOURNAL_ENV}: cannot write in {one_line(str(root), 200)} ({e.strerror or e}): a job "
                             "keeps there the outcomes its storage could not take; point it at a writable "
                             "directory") from None


class Journal:
    """The journal of one study on one storage (``storage`` is the redacted URL)."""

    def __init__(self, storage: str, study: str) -> None:
        root = journal_root()
        digest = hashlib.sha256(f"{storage}\n{study}".encode()).hexdigest()[:16]
        self.dir = root / digest

    def write(self, entry: Entry) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(entry, f)
        os.replace(tmp, self._path(entry.trial_number))

    def remove(self, trial_number: int) -> None:
        self._path(trial_number).unlink(missing_ok=True)

    def entries(self) -> list[Entry]:
        """Outcomes left by a driver that lost its storage, oldest trial first."""
        if not self.dir.is_dir():
            return []
        out = []
        for path in sorted(self.dir.glob("trial-*.pkl")):
            with path.open("rb") as f:
                out.append(pickle.load(f))  # noqa: S301 - our own file, see the module docstring
        return sorted(out, key=lambda e: e.trial_number)

    def _path(self, trial_number: int) -> Path:
        return self.dir / f"trial-{trial_number:08d}.pkl"
