"""deploy/compose.yaml, the single-workstation setup: the services it needs are there and
wired to each other (storage URL, env files, start order, GPUs), it builds the image from
deploy/Dockerfile, and nothing is published beyond 127.0.0.1.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml
from sqlalchemy.engine import make_url

from tests.deploy.deployfiles import COMPOSE, DEPLOY, ROOT

SPEC = yaml.safe_load(COMPOSE.read_text())
SERVICES = SPEC["services"]
ERASE_TUNE = [name for name, s in SERVICES.items() if "build" in s]


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


def _env_files(service: dict) -> list[str]:
    files = service.get("env_file") or []
    files = [files] if isinstance(files, (str, dict)) else files
    return [f["path"] if isinstance(f, dict) else f for f in files]


def test_services() -> None:
    assert {"postgres", "migrate", "ray-head", "dashboard"} <= set(SERVICES)
    assert set(ERASE_TUNE) == {"migrate", "ray-head", "dashboard"}


@pytest.mark.parametrize("name", ERASE_TUNE)
def test_erase_tune_services_build_the_deploy_image(name: str) -> None:
    service = SERVICES[name]
    build = service["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert context == ROOT, "the build context must be the repository root (it holds pyproject.toml)"
    assert (context / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert service["image"] == SERVICES["ray-head"]["image"], "one image for all of them"


@pytest.mark.parametrize("name", ERASE_TUNE)
def test_storage_is_the_postgres_service_without_password(name: str) -> None:
    service = SERVICES[name]
    url = make_url(_environment(service)["ERASE_TUNE_STORAGE"])
    assert url.drivername == "postgresql+psycopg" and url.password is None
    assert url.host == "postgres" and url.port == 5432
    postgres_env = _environment(SERVICES["postgres"])
    assert (url.username, url.database) == (postgres_env["POSTGRES_USER"], postgres_env["POSTGRES_DB"])
    # The password (PGPASSWORD) comes from the env file postgres takes its own from.
    assert "db.env" in _env_files(service) and "db.env" in _env_files(SERVICES["postgres"])


def test_env_files_are_git_ignored() -> None:
    files = {f for s in SERVICES.values() for f in _env_files(s)}
    assert files == {"db.env", "ray.env"}
    for f in sorted(files):
        path = (COMPOSE.parent / f).relative_to(ROOT).as_posix()
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0
        assert ignored, f"{path} holds secrets and must be git-ignored"


def test_start_order() -> None:
    assert SERVICES["postgres"]["healthcheck"]["test"]
    assert SERVICES["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("ray-head", "dashboard"):
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"


def test_ray_head_owns_the_gpus_with_token_auth() -> None:
    head = SERVICES["ray-head"]
    assert head["command"][:3] == ["ray", "start", "--head"] and "--block" in head["command"]
    devices = head["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert head.get("shm_size"), "Ray's object store needs more than Docker's 64 MB /dev/shm"
    assert _environment(head)["RAY_AUTH_MODE"] == "token" and "ray.env" in _env_files(head)


def test_dashboard_serves_on_the_published_port() -> None:
    dash = SERVICES["dashboard"]
    command = dash["command"]
    assert command[:2] == ["erase-tune", "dashboard"]
    assert command[command.index("--host") + 1] == "0.0.0.0"
    port = command[command.index("--port") + 1]
    assert any(str(p).endswith(f":{port}") for p in dash["ports"])


def test_ports_are_published_on_loopback_only() -> None:
    for name, service in SERVICES.items():
        for port in service.get("ports") or []:
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} would be reachable from the network"
