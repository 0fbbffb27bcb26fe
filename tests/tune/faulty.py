"""Test workloads that fail the way real trials fail: a hang, a dead worker, a NaN loss.

``tests.tune.faulty:workload(mode=...)`` is the real ``ctr`` proxy with one fault planted
(named by import path, as a user's own workload is). The fault fires in ``make_data`` or
the loss, which only the trial worker calls: the driver builds the model to check the
space's cuts, so it must never trip over the fault itself.

- ``ok``: the plain ctr workload.
- ``hang``: ``make_data`` sleeps forever (the driver must time the trial out).
- ``crash``: ``make_data`` kills its process with ``os._exit(3)`` (a segfault, an OOM kill, a
  lost node: an infrastructure failure, retried on a fresh worker).
- ``nan``: every loss is NaN (the trial must fail, naming the loss).
- ``raise``: ``make_data`` raises the same error in every trial (a workload broken for all plans).

``mode`` may also be a comma-separated script, e.g. ``ok,hang,crash,nan``: each trial
(each ``make_data`` call, in whichever worker) claims the next ticket in the directory
``tickets`` and plays that mode (``ok`` once the script is used up), so one job mixes
faults and healthy trials. With ``tickets`` given, every trial that runs leaves a ticket
``<n>-<mode>`` holding its worker's pid: tests count the trials that really ran and check
that a killed worker is gone.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from erase_tune.workloads import Workload, WorkloadData, ctr

MODES = ("ok", "hang", "crash", "nan", "raise")


def _claim(tickets: Path, script: list[str]) -> str:
    """The mode of the next free ticket: ticket files are created exclusively, so
    concurrent workers never play the same one."""
    for i in itertools.count():
        mode = script[i] if i < len(script) else (script[0] if len(script) == 1 else "ok")
        try:
            fd = os.open(tickets / f"{i}-{mode}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return mode
    raise AssertionError("unreachable")


def workload(*, mode: str = "ok", tickets: str = "", **ctr_args: Any) -> Workload:
    script = [m.strip() for m in mode.split(",")]
    if any(m not in MODES for m in script):
        raise ValueError(f"mode: {mode!r} is not one of {', '.join(MODES)} (or a comma-separated script of them)")
    if len(script) > 1 and not tickets:
        raise ValueError("a script of modes needs tickets=<directory>")
    base = ctr.workload(**ctr_args)
    state = {"mode": script[0]}

    def make_data(device: torch.device) -> WorkloadData:
        state["mode"] = _claim(Path(tickets), script) if tickets else script[0]
        if state["mode"] == "hang":
            while True:
                time.sleep(60)
        if state["mode"] == "crash":
            os._exit(3)
        if state["mode"] == "raise":
            raise RuntimeError("planted failure: the workload cannot build its data")
        return base.make_data(device)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = base.loss_fn(output, target)
        return loss * float("nan") if state["mode"] == "nan" else loss

    # every trial's make_data must run (it plays the trial's ticket): never kept between trials
    return dataclasses.replace(base, make_data=make_data, loss_fn=loss_fn, reuse_data=False,
                               args={**base.args, "mode": mode, "tickets": tickets})


# -- search spaces for the service tests --------------------------------------------------

TINY_CTR = {"batch": 64, "width": 8, "depth": 1, "emb_dim": 4, "num_tables": 4, "rows": 50, "sub_out": 4,
            "train_batches": 8, "eval_batches": 2}
"""CTR arguments small enough that a trial takes about a second on one CPU core."""


def write_space(path: Path, *, workload: str = "ctr", args: dict[str, Any] | None = None,
                budget: dict[str, Any] | None = None, cuts: dict[str, Any] | None = None,
                **fields: Any) -> Path:
    """Write a search-space file for a tiny CTR job; keyword arguments replace its fields.

    Defaults: three candidates that are detached or kept (a continuous λ, so a random sampler
    never proposes the same plan twice by chance), blocking dispatch, CPU, random sampler,
    60 s trial timeout, no confirmation windows beyond what a test asks for, no noise floor and
    no quality confirmation. A trial times a fixed number of windows (``max_windows`` =
    ``windows`` unless given): the stop rule would time a noisy trial on to 20, so on a loaded
    machine every trial would do several times the work, and load more the machine it measures.
    """
    space: dict[str, Any] = {
        "workload": {"name": workload, "args": {**TINY_CTR, **(args or {})}},
        "cuts": {"candidates": ["subarchs.0", "subarchs.1", "subarchs.2"], "max_streams": 1,
                 "modes": ["keep", "detach"], "dispatch": ["blocking"], "graph": [False],
                 "aux_weight": {"low": 0.3, "high": 3.0, "log": True}, **(cuts or {})},
        "max_ne_gap": 0.05,
        "sampler": {"name": "random", "seed": 0},
        # No noise floor and no quality confirmation unless a test asks: both call make_data,
        # which claims the fault scripts' tickets (tests/tune/test_noise_service.py covers them).
        # The front's re-measurement stops at 8 windows: a loaded machine's noise would time it on
        # to the default 40.
        "budget": {"warmup_steps": 5, "windows": 1, "window_steps": 2, "quality_steps": 5, "timeout_s": 60,
                   "noise_repeats": 0, "quality_scale": 0, "confirm_max_windows": 8, **(budget or {})},
        "trials": 3,
        "device": "cpu",
        **fields,
    }
    space["budget"].setdefault("max_windows", space["budget"]["windows"])
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path
