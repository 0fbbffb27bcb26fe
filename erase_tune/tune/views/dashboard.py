"""``erase-tune dashboard``: optuna-dashboard on the job's storage.

It binds to 127.0.0.1 unless told otherwise: the dashboard has no authentication, so
exposing it is a deliberate choice (``--host 0.0.0.0``).
"""

from __future__ import annotations

from erase_tune.errors import EraseTuneError
from erase_tune.store import default_storage_url
from erase_tune.store.storage import open_storage

__all__ = ["serve"]


def serve(storage: str | None, *, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Serve until interrupted."""
    from optuna_dashboard import run_server

    if not 0 < port < 65536:
        raise EraseTuneError(f"--port: {port} is not a TCP port")
    db = open_storage(storage if storage is not None else default_storage_url(), must_exist=True, upgrade=False)
    print(f"optuna-dashboard for {db.url} on http://{host}:{port}/ (Ctrl-C to stop)", flush=True)
    try:
        run_server(db.dashboard_storage, host=host, port=port)  # a request fails at once; the page reloads
    except OSError as e:
        raise EraseTuneError(f"dashboard: cannot listen on {host}:{port}: {e.strerror or e}") from None
    finally:
        db.close()
