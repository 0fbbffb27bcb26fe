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
    assert (ROOT / "erase_tune" / "py.typed").is_file() and (ROOT / "LICENSE").is_file()


SERVICE = ("optuna", "optuna_dashboard", "ray", "sqlalchemy", "alembic", "psycopg", "matplotlib")


def test_the_runtime_alone_needs_no_service_package():
    """`pip install erase-tune` (no extra) is what production training gets: the wheel's plain
    requirements are torch, pyyaml and numpy, and the runtime trains a model with a plan while
    every service package is unimportable."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plain = {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in meta["dependencies"]}
    assert plain == {"torch", "pyyaml", "numpy"}
    tune = {r.split(">")[0].split("=")[0].split("[")[0].strip().replace("-", "_") for r in meta["optional-dependencies"]["tune"]}
    assert set(SERVICE) <= tune
    code = (
        "import sys\n"
        f"blocked = {SERVICE!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in blocked: raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "from erase_tune import EraseEngine, ErasePlan\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))\n"
        "plan = ErasePlan.loads('cuts: [{module: \"0\"}]')\n"
        "x, y = torch.randn(8, 4), torch.rand(8, 1)\n"
        "loss = torch.nn.functional.binary_cross_entropy_with_logits\n"
        "engine = EraseEngine(model, plan, loss_fn=loss, example=((x,), y))\n"
        "print(float(engine.step((x,), y)) > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


def test_service_commands_say_what_to_install_when_it_is_missing():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'optuna': raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from erase_tune.cli import main\n"
        "sys.exit(main(['status', '--storage', 'sqlite:///nowhere.db']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "pip install 'erase-tune[tune]'" in out.stderr


def test_library_does_not_import_the_service_stack():
    code = (
        "import sys\n"
        "import erase_tune, erase_tune.runtime, erase_tune.workloads, erase_tune.measure, erase_tune.runtime.losscheck\n"
        "import erase_tune.measure.trial, erase_tune.measure.bench, erase_tune.measure.confirm\n"
        "import erase_tune.measure.noise, erase_tune.measure.estimate\n"
        "bad = sorted(m for m in ('optuna', 'ray', 'sqlalchemy', 'alembic') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"the library imported {out.stdout.strip()}"
