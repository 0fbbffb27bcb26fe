"""Limits on workload arguments: integer bounds, and a memory estimate checked before building.

A workload argument can ask for more than any machine holds (``rows: 1000000000000``) or for
so many modules that building the model never finishes (``depth: 10**9``). Unchecked, that
ends in the allocator's RuntimeError or the kernel's OOM killer, after a job was accepted
and its model half built. The built-in factories call these helpers before they return, and
a factory runs before anything is allocated, so such a job fails at once with one line that
names the argument.

The memory estimate is deliberately rough ("about"): parameters with their training state
(weights, gradients, Adam's moments), plus the data pools at the peak of building them;
activations are not counted. The cap is this machine's memory (or its cgroup limit): every
workload builds its model on the CPU first (``Workload.build_model``), and a CPU run holds
all of it there. For a run on an accelerator the check is conservative: the optimizer state
(and the ctr synthetic pools, generated on the device) then live in device memory.

The built-ins count their parameters by formula rather than by building the model, even on
the meta device: that costs about a millisecond per module, over a second at the argument
bounds (1024 embedding tables).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any
from collections.abc import Iterable, Mapping

from erase_tune.errors import WorkloadError, shown

__all__ = [
    "MAX_SEED",
    "INT_BOUNDS",
    "SYNTHETIC_BYTES_PER_EXAMPLE",
    "SYNTHETIC_BYTES_PER_TABLE",
    "SYNTHETIC_BYTES_PER_ID",
    "SYNTHETIC_BYTES_PER_TABLE_ROW",
    "SYNTHETIC_BYTES_PER_ROW",
    "CRITEO_BYTES_PER_LINE",
    "CRITEO_MIN_LINE_BYTES",
    "TRAINING_BYTES_PER_PARAMETER",
    "Need",
    "check_arg",
    "check_int",
    "check_ints",
    "check_memory",
    "pool_need",
    "popularity_need",
    "click_pool_needs",
    "format_bytes",
    "host_memory_bytes",
]

MAX_SEED = 2**32 - 1
"""Seeds are drawn from [0, 2**32): what every RNG we seed (torch, numpy) accepts as is."""

TRAINING_BYTES_PER_PARAMETER = 16
"""float32 weight, its gradient and Adam's two moments (every built-in trains with Adam)."""


def check_int(workload: str, name: str, value: int, low: int, high: int) -> None:
    """Raise :class:`WorkloadError` unless ``value`` is an integer in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise WorkloadError(f"workload {workload!r}: argument {name!r} must be an integer, got {shown(value)}")
    got = value if abs(value) < 10**40 else shown(value)  # the number itself while it is short
    if value < low:
        raise WorkloadError(f"workload {workload!r}: argument {name!r} must be an integer >= {low}, got {got}")
    if value > high:
        raise WorkloadError(f"workload {workload!r}: argument {name!r} must be an integer <= {high}, got {got}")


INT_BOUNDS = {
    "batch": (1, 2**20),
    "rows": (1, 2**40),
    "emb_dim": (1, 2**14),
    "num_tables": (1, 1024),
    "width": (1, 2**16),
    "train_batches": (1, 2**20),
    "eval_batches": (1, 2**20),
    "seed": (0, MAX_SEED),
}
"""Bounds on the integer arguments the built-ins share, by name: far above any real run, low
enough that no argument can make a factory hang. A workload's own are given to :func:`check_ints`."""


def check_ints(workload: str, args: Mapping[str, Any], names: Iterable[str],
               own: Mapping[str, tuple[int, int]] | None = None) -> None:
    """:func:`check_int` for each of ``names`` in turn, within its bounds in ``own`` where it is
    there (the workload's own arguments, or its own bound on a shared one), else in :data:`INT_BOUNDS`."""
    own = own or {}
    for name in names:
        low, high = own[name] if name in own else INT_BOUNDS[name]
        check_int(workload, name, args[name], low, high)


def check_arg(workload: str, name: str, value: Any, ok: bool, need: str) -> None:
    """Raise :class:`WorkloadError` naming argument ``name`` unless ``ok``: it must be ``need``."""
    if not ok:
        raise WorkloadError(f"workload {workload!r}: argument {name!r} must be {need}, got {shown(value)}")


@dataclasses.dataclass(frozen=True)
class Need:
    """The bytes one part of a workload needs, and the arguments that set them."""

    what: str
    """The part, as the message names it: ``"the embedding tables"``."""
    nbytes: int
    """Estimated bytes at the part's peak."""
    cause: str
    """The arguments that size it, as the message names them: ``"num_tables=26 x rows=1000"``."""


def host_memory_bytes() -> int:
    """This machine's physical memory, or this process's cgroup memory limit if lower."""
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except Exception:  # psutil missing or unable to read this platform: ask the OS directly
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # A container's OOM killer acts at its cgroup limit, not at the host's memory.
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units, two significant digits: ``6.7 TB``, ``24 GB``."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB", "EB", "ZB"):
        if n < 999.5 or unit == "ZB":
            break
        n /= 1000
    return f"{n:.2g} {unit}" if n < 10 else f"{n:.0f} {unit}"


def check_memory(workload: str, needs: Iterable[Need]) -> None:
    """Raise :class:`WorkloadError` (one line, naming the largest part and its arguments)
    when the parts together need more than this machine's memory."""
    needs = list(needs)
    total = sum(need.nbytes for need in needs)
    cap = host_memory_bytes()
    if total <= cap:
        return
    largest = max(needs, key=lambda need: need.nbytes)
    # Name the total too when the other parts matter: it is what the cap is compared with.
    in_all = f" ({format_bytes(total)} in all)" if total > 1.05 * largest.nbytes else ""
    raise WorkloadError(
        f"workload {workload!r}: {largest.cause} needs about {format_bytes(largest.nbytes)} for {largest.what}"
        f"{in_all}, more than this machine's {format_bytes(cap)} of memory"
    )


def pool_need(args: Mapping[str, Any], bytes_per_example: int, at_most: int | None = None) -> Need:
    """The train and eval pools: ``(train_batches + eval_batches) * batch`` examples (or
    ``at_most``, where fewer) of ``bytes_per_example`` each at the peak of building them."""
    examples = (args["train_batches"] + args["eval_batches"]) * args["batch"]
    if at_most is not None:
        examples = min(examples, at_most)
    return Need("the train/eval pools", examples * bytes_per_example,
                f"batch={args['batch']} x (train_batches={args['train_batches']} + eval_batches={args['eval_batches']})")


def popularity_need(tables: int, rows: int, cause: str) -> Need:
    """The synthetic ids' popularity order: a shuffled order of ``rows`` ids per table (or field)."""
    return Need("the synthetic ids' popularity order",
                rows * (SYNTHETIC_BYTES_PER_TABLE_ROW * tables + SYNTHETIC_BYTES_PER_ROW), cause)


def click_pool_needs(args: Mapping[str, Any], bag: int) -> list[Need]:
    """The pools of a click workload of ``num_tables`` tables (ctr, dlrm): drawn from the planted
    teacher (``data: synthetic``, ``bag`` ids per table and example), with its ids' popularity
    order; or read from the Criteo file ``data`` (at most as many lines as the file can hold)."""
    t, rows = args["num_tables"], args["rows"]
    if args["data"] == "synthetic":
        per_example = SYNTHETIC_BYTES_PER_EXAMPLE + SYNTHETIC_BYTES_PER_TABLE * t + SYNTHETIC_BYTES_PER_ID * t * bag
        return [pool_need(args, per_example), popularity_need(t, rows, f"num_tables={t} x rows={rows}")]
    lines = os.path.getsize(args["data"]) // CRITEO_MIN_LINE_BYTES + 1
    return [pool_need(args, CRITEO_BYTES_PER_LINE, at_most=lines)]


# Building the synthetic pool holds the teacher's intermediates for every example at once.
# Peak host memory measured on a CPU (torch 2.13; 24 to 48 batches of 4096, 8 and 26 tables,
# bag 1 and 4): 1.9-3.1 kB per example at bag 1, +26 B per extra id; and 17-20 B per table
# row plus 12 B per row for the ids' popularity order. Rounded up here.
SYNTHETIC_BYTES_PER_EXAMPLE = 1500
SYNTHETIC_BYTES_PER_TABLE = 70
SYNTHETIC_BYTES_PER_ID = 30
SYNTHETIC_BYTES_PER_TABLE_ROW = 20
SYNTHETIC_BYTES_PER_ROW = 12
# Reading a TSV keeps each line as Python lists (a float and 39 boxed numbers) until the
# tensors are built; the shortest valid line is 41 bytes (a label, 39 tabs, a newline).
CRITEO_BYTES_PER_LINE = 2000
CRITEO_MIN_LINE_BYTES = 41
