"""Reader for Criteo-format click logs (the Kaggle / Terabyte TSV layout).

Each line is ``label \\t I1..I13 \\t C1..C26``: a 0/1 click, 13 integer counts and 26
categorical ids written as hex strings; any feature may be empty. This turns such a file
into the tensors the ``ctr`` workload trains on, so a trial can run on real clicks instead
of the planted teacher.

Categoricals are hashed with CRC-32, not Python's ``hash()``: that one is salted per process,
and a hash that changes between the trial that tuned a plan and the run that uses it would
silently change the data.
"""

from __future__ import annotations

import math
import os
import zlib

import torch
from torch import Tensor

from erase_tune.errors import WorkloadError, shown
from erase_tune.workloads.limits import check_arg

__all__ = [
    "NUM_DENSE", "NUM_SPARSE", "check_criteo_data", "load_criteo_tsv", "load_criteo_batch", "load_criteo_split",
]

NUM_DENSE = 13
NUM_SPARSE = 26
_FIELDS = 1 + NUM_DENSE + NUM_SPARSE


def _parse_line(line: str, rows: int, where: str) -> tuple[float, list[float], list[int]]:
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != _FIELDS:
        raise WorkloadError(f"{where}: expected {_FIELDS} tab-separated fields, got {len(fields)}")
    if fields[0] not in ("0", "1"):
        raise WorkloadError(f"{where}: label must be 0 or 1, got {shown(fields[0])}")
    dense = []
    for i, text in enumerate(fields[1 : 1 + NUM_DENSE], start=1):
        try:
            value = int(text) if text else 0
        except ValueError:
            raise WorkloadError(f"{where}: integer feature I{i} is not an integer: {shown(text)}") from None
        # Counts are heavy-tailed; log1p is the usual Criteo transform (negatives are noise).
        try:
            dense.append(math.log1p(max(value, 0)))
        except OverflowError:  # past float's range (a 400-digit count): no count is that large
            raise WorkloadError(f"{where}: integer feature I{i} is too large for a count: {shown(value)}") from None
    sparse = [zlib.crc32(text.encode()) % rows if text else 0 for text in fields[1 + NUM_DENSE :]]
    return float(fields[0]), dense, sparse


def load_criteo_tsv(
    path: str | os.PathLike[str], *, rows: int, max_lines: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Read up to ``max_lines`` examples from a Criteo TSV.

    Returns ``dense`` (N, 13) float32 (``log1p`` of the counts; empty or negative → 0),
    ``sparse`` (N, 26, 1) int64 (CRC-32 of the id string modulo ``rows``; empty → 0) and
    ``labels`` (N,) float32. Blank lines are skipped. Raises :class:`WorkloadError` naming
    the file and line for a malformed line, and for a missing, unreadable or empty file.
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise WorkloadError(f"criteo: rows must be an integer >= 1, got {shown(rows)}")
    labels: list[float] = []
    dense: list[list[float]] = []
    sparse: list[list[int]] = []
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            for number, line in enumerate(handle, start=1):
                if max_lines is not None and len(labels) >= max_lines:
                    break
                if not line.strip():
                    continue
                label, d, s = _parse_line(line, rows, f"criteo file {str(path)!r} line {number}")
                labels.append(label)
                dense.append(d)
                sparse.append(s)
    except OSError as exc:
        raise WorkloadError(f"criteo file {str(path)!r}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"criteo file {str(path)!r}: not UTF-8 text ({exc.reason})") from None
    if not labels:
        raise WorkloadError(f"criteo file {str(path)!r}: no examples")
    return (
        torch.tensor(dense, dtype=torch.float32),
        torch.tensor(sparse, dtype=torch.int64).unsqueeze(-1),
        torch.tensor(labels, dtype=torch.float32),
    )


def check_criteo_data(workload: str, data: str, num_tables: int) -> None:
    """Check a workload's ``data`` and ``num_tables`` arguments for a Criteo TSV: the file must
    be readable, and the model must have the format's 26 tables; a one-line
    :class:`WorkloadError` naming ``workload`` otherwise."""
    check_arg(workload, "data", data, os.path.isfile(data), "'synthetic' or the path of a readable Criteo TSV file")
    check_arg(workload, "num_tables", num_tables, num_tables == NUM_SPARSE, f"{NUM_SPARSE} with Criteo data")


def load_criteo_batch(path: str, *, rows: int, batch: int, workload: str) -> tuple[Tensor, Tensor, Tensor]:
    """The file's first ``batch`` lines, as :func:`load_criteo_tsv` reads them: the first
    training batch ``make_data`` gives, which is what a workload's ``make_example`` needs. A
    shorter file raises :class:`WorkloadError` naming ``workload``."""
    dense, sparse, labels = load_criteo_tsv(path, rows=rows, max_lines=batch)
    if len(labels) < batch:
        raise WorkloadError(f"workload {shown(workload)}: data {path!r} has {len(labels)} lines, too few for one "
                            f"training batch of {batch}")
    return dense, sparse, labels


def load_criteo_split(path: str, *, rows: int, batch: int, train_batches: int, eval_batches: int,
                      workload: str) -> tuple[tuple[Tensor, Tensor, Tensor], slice, slice]:
    """Read up to ``(train_batches + eval_batches)·batch`` lines of a Criteo TSV and split them:
    the last lines (``eval_batches``' share of what was read) are held out, so a short file
    still gets a proportional split; the train pool keeps full batches only (static shapes for
    CUDA graphs). Returns ``(dense, sparse, labels)`` and the train and held-out slices."""
    want_train, want_eval = train_batches * batch, eval_batches * batch
    dense, sparse, labels = load_criteo_tsv(path, rows=rows, max_lines=want_train + want_eval)
    n = len(labels)
    n_eval = max(1, round(n * want_eval / (want_train + want_eval)))
    n_train = (n - n_eval) // batch * batch
    if n_train == 0:
        raise WorkloadError(f"workload {shown(workload)}: data {path!r} has {n} lines, too few for one training batch "
                            f"of {batch} plus a held-out split")
    return (dense, sparse, labels), slice(0, n_train), slice(n - n_eval, n)
