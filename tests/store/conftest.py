"""Store fixtures: the store API on an empty or migrated database of each supported kind.

The database fixtures (``storage_url``: SQLite and PostgreSQL) live in tests/conftest.py,
shared with the service tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from erase_tune.store import Store


@pytest.fixture
def store(storage_url: str) -> Iterator[Store]:
    """A store on an empty, un-migrated database."""
    s = Store(storage_url)
    yield s
    s.close()


@pytest.fixture
def migrated(store: Store) -> Store:
    """A store whose database is at head."""
    store.upgrade()
    return store

