"""Packaging facts a user relies on: every subpackage ships, migrations ship, and the library
layer stays free of the service's dependencies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.relative_to(ROOT).parent.parts)
        for p in (ROOT / "erase_tune").rglob("__init__.py")
    }
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert {"erase_tune._alembic", "erase_tune._alembic.versions"} <= listed
    assert list((ROOT / "alembic" / "versions").glob("0001_*.py"))


def test_library_does_not_import_the_service_stack():
    code = (
        "import sys\n"
        "import erase_tune, erase_tune.runtime, erase_tune.workloads, erase_tune.measure, erase_tune.trial, erase_tune.bench\n"
        "bad = sorted(m for m in ('optuna', 'ray', 'sqlalchemy', 'alembic') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"the library imported {out.stdout.strip()}"
