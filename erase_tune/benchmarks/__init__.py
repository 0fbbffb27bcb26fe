"""One benchmark runner with named cases and suites: what regenerates docs/benchmarks.md.

    python -m erase_tune.benchmarks --list
    python -m erase_tune.benchmarks CASE [CASE...] --out DIR [case options]
    python -m erase_tune.benchmarks --suite NAME --out DIR [--dry-run]

A case (:mod:`erase_tune.benchmarks.case`) writes ``DIR/CASE.json`` (its result with provenance)
and ``DIR/CASE.log``, and prints a short table last; a suite (:mod:`erase_tune.benchmarks.suites`)
runs steps under time limits as the GPU campaign did. Importing this package imports neither the
tuning service nor its dependencies; the cases that need them import them when they run.
"""

from __future__ import annotations

import importlib

from erase_tune.benchmarks.case import CASES, Case, Context

__all__ = ["CASES", "CASE_MODULES", "Case", "Context", "load_cases"]

CASE_MODULES = ("campaign_space", "ddp_table1", "graph_drift", "host_profile", "host_table", "host_trace",
                "mlp_backward", "ne_evidence", "rank_agreement", "replay_table", "sampler_efficiency", "study_recheck")


def load_cases() -> dict[str, Case]:
    """Every case, registered by importing its module."""
    for name in CASE_MODULES:
        importlib.import_module(f"erase_tune.benchmarks.{name}")
    return dict(sorted(CASES.items()))
