"""Alembic environment for erase-tune's own tables (``et_*``), and only those.

Normally run through :mod:`erase_tune.store.migrate`, which passes an open connection in
``config.attributes["connection"]`` (inside a transaction it owns) or, for offline SQL, a
URL in ``config.attributes["url"]``. A developer can also run the ``alembic`` command
line with the repo's ``alembic.ini``, taking the URL from ``$ERASE_TUNE_STORAGE``.

Optuna keeps its tables, and its own ``alembic_version``, in the same database: our
revisions go to ``erase_tune_alembic_version``, and the ``include_name``/``include_object``
filters keep autogenerate (and so every revision written from it) away from Optuna's tables.
"""

from __future__ import annotations

import logging.config
import os

from alembic import context
from sqlalchemy import Connection

from erase_tune.errors import EraseTuneError
from erase_tune.store.engine import WRITE_OPTION, build_engine, parse_url
from erase_tune.store.models import VERSION_TABLE, Base, include_name, include_object

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

_OPTIONS = dict(
    target_metadata=target_metadata,
    version_table=VERSION_TABLE,
    include_name=include_name,
    include_object=include_object,
    compare_type=True,
    # SQLite cannot ALTER most things: later revisions get table-rebuild batches there.
    render_as_batch=True,
)


def _url() -> str:
    url = (
        config.attributes.get("url")
        or os.environ.get("ERASE_TUNE_STORAGE")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise EraseTuneError(
            "no database for Alembic: set ERASE_TUNE_STORAGE or use `erase-tune db upgrade --storage URL`"
        )
    return url


def run_migrations_offline() -> None:
    """Emit the SQL instead of running it (``alembic upgrade --sql``)."""
    context.configure(url=parse_url(_url()), literal_binds=True, dialect_opts={"paramstyle": "named"}, **_OPTIONS)
    with context.begin_transaction():
        context.run_migrations()


def _run(connection: Connection) -> None:
    context.configure(connection=connection, **_OPTIONS)
    # With the caller's transaction already open this joins it; the caller commits.
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = build_engine(parse_url(_url()))
    try:
        with engine.connect() as conn:
            _run(conn.execution_options(**{WRITE_OPTION: True}))
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
