"""``erase-tune dashboard``: optuna-dashboard on the job's storage.

It binds to 127.0.0.1 unless told otherwise: the dashboard has no authentication, so
exposing it is a deliberate choice (``--host 0.0.0.0``).
"""

from __future__ import annotations

from erase_tune.errors import EraseTuneError
from erase_tune.store import default_storage_url, redact_url
from erase_tune.tune.study import rdb_storage

__all__ = ["serve"]


def serve(storage: str | None, *, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Serve until interrupted."""
    from optuna_dashboard import run_server

    url = storage or default_storage_url()
    if not 0 < port < 65536:
        raise EraseTuneError(f"--port: {port} is not a TCP port")
    rdb = rdb_storage(url)
    print(f"optuna-dashboard for {redact_url(url)} on http://{host}:{port}/ (Ctrl-C to stop)", flush=True)
    try:
        run_server(rdb, host=host, port=port)
    except OSError as e:
        raise EraseTuneError(f"dashboard: cannot listen on {host}:{port}: {e.strerror or e}") from None
