"""A Ray address where something that is not Ray listens: one line in seconds, never Ray's own
minutes of retries (issue 30). No Ray is started."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from erase_tune.errors import EraseTuneError
from erase_tune.tune.execute.executor import PROBE_S, _check_reachable
from tests.tune.conftest import SMOKE, run_cli
from tests.tune.test_cli_errors import one_error_line

SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@pytest.fixture
def listener(request):
    """A port answered by ``request.param``: silent, an HTTP server, one that hangs up, or one
    that answers as a gRPC server does (an HTTP/2 SETTINGS frame)."""
    kind = request.param
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            if kind == "http":
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            elif kind == "grpc":
                conn.sendall(SETTINGS)
            elif kind == "closer":
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for conn in held:
        conn.close()


@pytest.mark.parametrize("listener", ["silent", "http", "closer"], indirect=True)
@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_a_listener_that_is_not_ray_is_refused_in_seconds(listener, scheme):
    t0 = time.monotonic()
    with pytest.raises(EraseTuneError, match=f"something answers at {scheme}127.0.0.1:{listener}, and it is not Ray"):
        _check_reachable(f"{scheme}127.0.0.1:{listener}")
    assert time.monotonic() - t0 < PROBE_S + 2


@pytest.mark.parametrize("listener", ["grpc"], indirect=True)
def test_a_grpc_server_passes_the_probe(listener):
    _check_reachable(f"127.0.0.1:{listener}")
    _check_reachable(f"ray://127.0.0.1:{listener}")


@pytest.mark.parametrize("listener", ["http"], indirect=True)
@pytest.mark.parametrize("how", ["option", "environment"])
def test_start_at_a_listener_that_is_not_ray_is_one_line_and_touches_nothing(listener, how, tmp_path, capsys,
                                                                            monkeypatch):
    db = tmp_path / "s.db"
    address = f"127.0.0.1:{listener}"
    argv = ["start", "--space", SMOKE, "--storage", f"sqlite:///{db}"]
    if how == "option":
        argv += ["--ray-address", address]
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    assert run_cli(*argv) == 2
    one_error_line(capsys.readouterr().err, "it is not Ray", "HTTP/1.1")
    assert not db.exists()
