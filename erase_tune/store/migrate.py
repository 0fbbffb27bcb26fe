"""Alembic, driven from code: find the migration scripts, upgrade, downgrade, check.

The scripts live in the repository's top-level ``alembic/`` directory and are installed
into the wheel as ``erase_tune/_alembic``, so ``erase-tune db upgrade`` works from an
installed package with no ``alembic.ini`` anywhere. Alembic is configured here in code; the
engine's connection is handed to ``env.py`` through ``Config.attributes``, so the URL (and
its password) never goes through Alembic's config parser or its log.

Our revisions are recorded in their own version table (``erase_tune_alembic_version``):
Optuna keeps its schema version in ``alembic_version`` in the same database.
"""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

from alembic import command
from erase_tune.errors import EraseTuneError
from erase_tune.store.engine import WRITE_OPTION
from erase_tune.store.models import VERSION_TABLE
from erase_tune.store.values import SchemaVersion

__all__ = ["SchemaError", "scripts_dir", "alembic_config", "head_revision", "schema_version",
           "upgrade", "downgrade", "check_schema", "upgrade_sql"]


class SchemaError(EraseTuneError):
    """The database's erase-tune tables are not at the revision this erase-tune needs."""


def scripts_dir() -> Path:
    """The Alembic scripts: inside the installed package if shipped there, else the repo's."""
    shipped = resources.files("erase_tune") / "_alembic"
    # A wheel installs as plain files, so this is a real path (Alembic needs one).
    if isinstance(shipped, Path) and shipped.is_dir():
        return shipped
    repo = Path(__file__).resolve().parents[2] / "alembic"
    if (repo / "env.py").is_file():
        return repo
    raise EraseTuneError(
        "erase-tune's database migrations are missing from this installation "
        f"(looked in erase_tune/_alembic and {repo}): reinstall erase-tune"
    )


def alembic_config(connection: Connection | None = None, *, url: str | None = None,
                   sql_out: io.StringIO | None = None) -> Config:
    """A Config built in code. ``connection`` (online) or ``url`` (offline SQL, written to
    ``sql_out``) go through ``attributes``, never through the ini parser, which would also
    choke on a ``%`` in a password. Alembic's chatter goes nowhere: the CLI prints its own."""
    cfg = _bare_config(scripts_dir(), sql_out)
    cfg.attributes["connection"] = connection
    cfg.attributes["url"] = url
    # env.py must not reconfigure the caller's logging (it would, from an ini file).
    cfg.attributes["configure_logger"] = False
    return cfg


def _bare_config(location: Path, sql_out: io.StringIO | None = None) -> Config:
    cfg = Config(stdout=io.StringIO(), output_buffer=sql_out)
    # Options go through configparser interpolation: a '%' in the path must be doubled.
    cfg.set_main_option("script_location", str(location).replace("%", "%%"))
    cfg.set_main_option("path_separator", "os")
    return cfg


@functools.lru_cache(maxsize=None)
def _scripts(location: Path) -> ScriptDirectory:
    # Parsing the revision files once per process is enough: they do not change under us.
    return ScriptDirectory.from_config(_bare_config(location))


def head_revision() -> str:
    """The revision this erase-tune's code expects."""
    heads = _scripts(scripts_dir()).get_heads()
    if len(heads) != 1:
        raise EraseTuneError(f"erase-tune's migrations have {len(heads)} heads ({', '.join(heads)}): a packaging bug")
    return heads[0]


def _known_revisions() -> set[str]:
    return {s.revision for s in _scripts(scripts_dir()).walk_revisions()}


def schema_version(connection: Connection) -> SchemaVersion:
    """Where the database's erase-tune tables stand (:class:`~erase_tune.store.values.SchemaVersion`)."""
    revision = _recorded(connection)
    return SchemaVersion(revision=revision, head=head_revision(),
                         known=revision is None or revision in _known_revisions())


def _recorded(connection: Connection) -> str | None:
    """The revision recorded in the database; None for a database never upgraded (or at base)."""
    ctx = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    heads = ctx.get_current_heads()
    if len(heads) > 1:
        raise SchemaError(
            f"the database's version table {VERSION_TABLE} holds {len(heads)} revisions ({', '.join(sorted(heads))}); "
            f"a database is at one: delete the row that does not belong there (this erase-tune writes "
            f"{head_revision()}), then run `erase-tune db upgrade`"
        )
    return heads[0] if heads else None


@contextlib.contextmanager
def _migration_connection(engine: Engine) -> Iterator[Connection]:
    # One transaction for the whole run: PostgreSQL (and SQLite, with the BEGIN handling
    # in engine.py) then roll a failed migration back completely.
    with engine.connect() as conn:
        conn = conn.execution_options(**{WRITE_OPTION: True})
        with conn.begin():
            yield conn


def upgrade(engine: Engine, revision: str = "head") -> None:
    with _migration_connection(engine) as conn:
        version = schema_version(conn)  # (and one revision, not several)
        if version.state == "ahead":  # a newer erase-tune's database: nothing to migrate to
            raise SchemaError(version.problem(""))
        command.upgrade(alembic_config(conn), revision)


def downgrade(engine: Engine, revision: str = "base") -> None:
    with _migration_connection(engine) as conn:
        command.downgrade(alembic_config(conn), revision)


def upgrade_sql(url: str, revision: str = "head") -> str:
    """The SQL an upgrade would run (Alembic's offline mode), for a DBA to review."""
    out = io.StringIO()
    command.upgrade(alembic_config(url=url, sql_out=out), revision, sql=True)
    return out.getvalue()


def check_schema(connection: Connection, shown_url: str) -> None:
    """Raise :class:`SchemaError` unless the database is exactly at our head revision.

    ``shown_url`` is the already redacted URL to put in the advice.
    """
    problem = schema_version(connection).problem(shown_url)
    if problem is not None:
        raise SchemaError(problem)
