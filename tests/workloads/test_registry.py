"""Workload registry: built-ins by name, user factories by import path, one-line errors."""

from __future__ import annotations

import re
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from erase_tune.errors import WorkloadError
from erase_tune.workloads import BUILTINS, Workload, get_workload


def _raises(match: str, name: str, args=None) -> str:
    with pytest.raises(WorkloadError, match=match) as info:
        get_workload(name, args)
    message = str(info.value)
    assert "\n" not in message, "errors must be one line"
    return message


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a module into tmp_path, importable under a fresh name; forget it afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(source: str) -> str:
        name = f"user_workload_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


_USER_FACTORY = """
    import torch
    from torch import nn
    import torch.nn.functional as F
    from erase_tune.workloads import Workload, WorkloadData

    def make(*, width: int = 4, scale: float = 1.0, tag: str | None = None) -> Workload:
        def data(device):
            x = torch.ones(2, width, device=device)
            y = torch.zeros(2, dtype=torch.long, device=device)
            return WorkloadData(train=[((x,), y)], eval=[((x,), y)], prior_entropy=0.5)
        return Workload(
            name="whatever", args={}, build_model=lambda: nn.Linear(width, 2),
            loss_fn=F.cross_entropy, make_data=data, cut_candidates=(), batch_size=2,
        )

    def not_a_workload(**kwargs):
        return [1, 2, 3]

    def broken(*, n: int = 1):
        raise RuntimeError("boom\\nsecond line")

    NOT_CALLABLE = 3
"""


def test_builtins_build_with_defaults() -> None:
    assert BUILTINS == ("ctr", "gpt", "mlp", "dlrm", "deepfm")
    for name in BUILTINS:
        wl = get_workload(name)
        assert isinstance(wl, Workload) and wl.name == name
        assert wl.args["seed"] == 0 and wl.batch_size == wl.args["batch"]
        assert wl.cut_candidates


def test_args_are_passed_and_recorded() -> None:
    wl = get_workload("ctr", {"batch": 32, "lr": 1})  # an int is fine where a float is expected
    assert wl.args["batch"] == 32 and wl.args["lr"] == 1.0 and isinstance(wl.args["lr"], float)


def test_unknown_name() -> None:
    msg = _raises(r"unknown workload 'nope'", "nope")
    assert "ctr, gpt, mlp, dlrm, deepfm" in msg


def test_unknown_argument_lists_the_known_ones() -> None:
    msg = _raises(r"^workload 'ctr': unknown argument 'widht' \(arguments: batch, width, ", "ctr", {"widht": 3})
    assert "seed" in msg
    _raises(r"unknown arguments 'a', 'b'", "gpt", {"a": 1, "b": 2})


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"batch": "abc"}, r"^workload 'ctr': argument 'batch' must be int, got str 'abc'$"),
        ({"batch": 2.5}, r"argument 'batch' must be int, got float 2.5"),
        ({"batch": True}, r"argument 'batch' must be int, got bool True"),
        ({"lr": "fast"}, r"argument 'lr' must be float, got str"),
        ({"data": 3}, r"argument 'data' must be str or PathLike"),
    ],
)
def test_wrong_type(args: dict, match: str) -> None:
    _raises(match, "ctr", args)


def test_bad_values_from_builtins() -> None:
    _raises(r"^workload 'ctr': argument 'batch' must be an integer >= 1, got 0$", "ctr", {"batch": 0})
    _raises(r"workload 'gpt': argument 'n_embd' \(30\) must be a multiple of 'n_head'", "gpt", {"n_embd": 30})
    _raises(r"workload 'mlp': argument 'dataset' must be one of digits, synthetic", "mlp", {"dataset": "mnist"})
    _raises(r"argument 'data' must be 'synthetic' or the path", "ctr", {"data": "/no/such/file.tsv"})


def test_args_must_be_a_mapping() -> None:
    _raises(r"arguments must be a mapping, got list", "ctr", [("batch", 3)])


def test_bad_import_paths(user_module) -> None:
    missing = r"^workload 'no_such_pkg_x.mod:f': cannot import module 'no_such_pkg_x.mod' \(ModuleNotFoundError"
    _raises(missing, "no_such_pkg_x.mod:f")
    _raises(r"not of the form 'package.module:function'", "pkg.mod:")
    _raises(r"not of the form", "pkg mod:f")
    mod = user_module(_USER_FACTORY)
    _raises(rf"module '{mod}' has no attribute 'missing'", f"{mod}:missing")
    _raises(r"'NOT_CALLABLE' is a int, not a callable factory", f"{mod}:NOT_CALLABLE")
    broken = user_module("x = (\n")
    _raises(rf"cannot import module '{broken}' \(SyntaxError", f"{broken}:f")


def test_user_workload_by_import_path(user_module) -> None:
    mod = user_module(_USER_FACTORY)
    wl = get_workload(f"{mod}:make", {"width": 3})
    assert wl.name == f"{mod}:make"
    assert dict(wl.args) == {"width": 3, "scale": 1.0, "tag": None}  # defaults recorded as provenance
    model = wl.build_model()
    (inputs, target) = wl.make_data(torch.device("cpu")).batch(0)
    assert wl.loss_fn(model(*inputs), target).ndim == 0


def test_user_factory_errors(user_module) -> None:
    mod = user_module(_USER_FACTORY)
    unknown = rf"^workload '{mod}:make': unknown argument 'depth' \(arguments: width, scale, tag\)$"
    _raises(unknown, f"{mod}:make", {"depth": 2})
    _raises(r"argument 'width' must be int, got str", f"{mod}:make", {"width": "3"})
    _raises(r"argument 'tag' must be str or None, got int 5", f"{mod}:make", {"tag": 5})
    _raises(r"factory returned list, expected erase_tune.workloads.Workload", f"{mod}:not_a_workload")
    msg = _raises(r"factory failed: RuntimeError: boom second line", f"{mod}:broken")
    assert re.search(rf"^workload '{mod}:broken'", msg)


LAUGHS = "[" + ", ".join(["&l0 [x, x, x, x, x, x, x, x, x, x]"] +
                         [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]) + "]"
"""A billion laughs in one --arg value: 10^9 strings through 255 bytes of aliases."""


@pytest.mark.parametrize(("value", "needle"), [
    (LAUGHS, "more than 100000 values"),  # was: repr() of 10^9 strings in the type error (minutes, GBs)
    ("&a [*a]", "nested more than 32 levels deep"),
    ("[" * 600, "nested more than 32 levels deep"),
    ("{a: 1, a: 2}", "the key 'a' appears twice"),
])
def test_an_arg_value_is_read_within_a_yaml_files_bounds(value: str, needle: str) -> None:
    import time

    from erase_tune.workloads import workload_args

    t0 = time.monotonic()
    with pytest.raises(WorkloadError, match=re.escape(f"--arg rows: ") + ".*" + re.escape(needle)) as info:
        workload_args([f"rows={value}"])
    assert time.monotonic() - t0 < 2 and len(str(info.value)) < 300


def test_arg_values_that_are_not_yaml_stay_text() -> None:
    from erase_tune.workloads import workload_args

    assert workload_args(["dims=512-256-128", "lr=1e-3", "rows=4096", "x=", "bad=[unclosed", "big=" + "9" * 5000]) == {
        "dims": "512-256-128", "lr": 1e-3, "rows": 4096, "x": "", "bad": "[unclosed", "big": "9" * 5000}


def test_an_arg_without_a_value_shows_a_bounded_line() -> None:
    from erase_tune.errors import EraseTuneError
    from erase_tune.workloads import workload_args

    with pytest.raises(EraseTuneError, match="is not KEY=VALUE") as info:
        workload_args(["x" * 100_000])
    assert len(str(info.value)) < 200
