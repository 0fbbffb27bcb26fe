"""deploy/Dockerfile: a CUDA PyTorch base within erase-tune's torch range, erase-tune installed
from the wheel its builder stage makes of this repository (with the tune extra and Ray
pinned), a numeric non-root user last; and the build context its .dockerignore lets through
is enough to build that wheel.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import tomllib

from tests.deploy.deployfiles import DEPLOY, DOCKERFILE, ROOT, dockerfile_stages, dockerignore_allows

STAGES = dockerfile_stages(DOCKERFILE.read_text())
BUILDER, FINAL = STAGES[0], STAGES[-1]
IGNORE = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()


def _runs(stage) -> list[str]:
    return [i.args for i in stage["instructions"] if i.keyword == "RUN"]


def _copies(stage) -> list[list[str]]:
    return [i.args.split() for i in stage["instructions"] if i.keyword == "COPY"]


def test_base_is_a_cuda_pytorch_image_in_erase_tunes_torch_range() -> None:
    m = re.fullmatch(r"pytorch/pytorch:(\d+)\.(\d+)\.(\d+)-cuda(\d+)\.(\d+)-cudnn\d+-runtime", FINAL["from"])
    assert m, f"base {FINAL['from']!r} is not a pinned pytorch/pytorch CUDA runtime tag"
    torch = (int(m.group(1)), int(m.group(2)))
    assert (2, 11) <= torch < (2, 15), "torch must be in erase-tune's range (pyproject: torch>=2.11,<2.15)"
    assert int(m.group(4)) in (12, 13), "CUDA 12.x or 13.x"
    assert BUILDER["from"] == FINAL["from"], "the wheel is built with the image's own Python"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(d.replace(" ", "").startswith("torch>=2.11") for d in pyproject["project"]["dependencies"])


def test_builder_makes_the_wheel_from_the_repositorys_pyproject() -> None:
    assert len(STAGES) >= 2 and BUILDER["name"], "a named builder stage"
    copied = {src for args in _copies(BUILDER) for src in args[:-1] if not src.startswith("--")}
    assert {"pyproject.toml", "README.md", "erase_tune", "alembic"} <= copied
    assert any(re.search(r"pip wheel .*--no-deps .*\s\.$", run) for run in _runs(BUILDER))


def test_image_installs_the_wheel_with_the_tune_extra_and_pinned_ray() -> None:
    installs = [run for run in _runs(FINAL) if "pip install" in run]
    assert len(installs) == 1
    run = installs[0]
    copied_from_builder = any(f"--from={BUILDER['name']}" in args for args in _copies(FINAL))
    assert f"from={BUILDER['name']}" in run or copied_from_builder, "the wheel comes from the builder stage"
    assert re.search(r"erase_tune-\*\.whl\)\[tune\]", run), "install the built wheel, with the tune extra"
    assert '"ray[default]==${RAY_VERSION}"' in run
    args = dict(i.args.split("=", 1) for i in FINAL["instructions"] if i.keyword == "ARG" and "=" in i.args)
    assert re.fullmatch(r"2\.60\.\d+", args["RAY_VERSION"])
    assert "torch.__version__ == sys.argv[1]" in run, "the build checks pip kept the base image's CUDA torch"


def test_last_user_is_numeric_and_not_root() -> None:
    users = [i for i in FINAL["instructions"] if i.keyword == "USER"]
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].args.partition(":")
    assert uid.isdigit() and int(uid) != 0, "numeric, so Kubernetes' runAsNonRoot can verify it"
    assert not gid or (gid.isdigit() and int(gid) != 0)
    later = [i for i in FINAL["instructions"] if i.line > users[-1].line]
    assert all(i.keyword in ("RUN", "CMD", "ENTRYPOINT", "LABEL", "EXPOSE") for i in later)


def test_dockerignore_keeps_what_the_dockerfile_copies_and_drops_the_rest() -> None:
    for stage in STAGES:
        for args in _copies(stage):
            if any(a.startswith("--from") for a in args):
                continue
            for src in args[:-1]:
                if src.startswith("--"):
                    continue
                files = [p for p in (ROOT / src).rglob("*") if p.is_file()] if (ROOT / src).is_dir() else [ROOT / src]
                assert files, f"COPY {src}: nothing there"
                for f in files:
                    path = f.relative_to(ROOT).as_posix()
                    if "__pycache__" not in path:
                        assert dockerignore_allows(IGNORE, path), f"{path} is copied but .dockerignore drops it"
    for private in (".git/HEAD", ".venv/bin/python", "erase-tune.db", "best.yaml", "tests/conftest.py",
                    "deploy/db.env", "erase_tune/__pycache__/cli.cpython-312.pyc"):
        assert not dockerignore_allows(IGNORE, private), f"{private} would be sent to the builder"


@pytest.mark.slow
def test_the_context_dockerignore_lets_through_builds_the_wheel(tmp_path) -> None:
    """What the builder stage runs, on the files the build context would hold."""
    context = tmp_path / "context"
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT).as_posix()
        if path.is_file() and not rel.startswith(".git/") and dockerignore_allows(IGNORE, rel):
            (context / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, context / rel)
    wheels = tmp_path / "wheels"
    # --no-build-isolation: the test machine has setuptools and no index; the image build
    # fetches pyproject's build requirements itself.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--wheel-dir", str(wheels), str(context)], check=True, capture_output=True, text=True)
    (wheel,) = wheels.glob("erase_tune-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "erase_tune/cli.py" in names
    assert any(n.startswith("erase_tune/_alembic/versions/") for n in names), "migrations ship in the wheel"
    assert re.search(r"^erase-tune\s*=\s*erase_tune\.cli:main$", entry_points, re.MULTILINE)
