"""A PostgreSQL URL at a port where something else answers: one line within the connect
timeout, never a silent wait for good (issue 30)."""

from __future__ import annotations

import socket
import time

import pytest

from erase_tune.errors import EraseTuneError
from erase_tune.store.engine import PG_CONNECT_TIMEOUT_S, connect_args, parse_url
from erase_tune.store.storage import open_storage, reach_storage


@pytest.fixture
def silent_port():
    """A listener that accepts connections and never says a word."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("call", [
    lambda url: reach_storage(url),  # start, before Ray
    lambda url: open_storage(url, must_exist=True, upgrade=False),  # status, report, db current
    lambda url: open_storage(url),  # db upgrade, export
])
def test_a_port_that_never_answers_is_one_line_within_the_connect_timeout(silent_port, call):
    url = f"postgresql+psycopg://u:s3cret@127.0.0.1:{silent_port}/db"
    t0 = time.monotonic()
    with pytest.raises(EraseTuneError, match="connection timeout expired .*no PostgreSQL answer within 2 s") as info:
        call(url)
    assert time.monotonic() - t0 < PG_CONNECT_TIMEOUT_S + 5
    assert "s3cret" not in str(info.value) and "\n" not in str(info.value)


def test_a_urls_own_connect_timeout_wins():
    assert connect_args(parse_url("postgresql+psycopg://u@h/db")) == {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    assert connect_args(parse_url("postgresql+psycopg://u@h/db?connect_timeout=30")) == {}
    assert connect_args(parse_url("sqlite:///x.db")) == {}
