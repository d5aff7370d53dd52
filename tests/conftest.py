"""Fixtures shared by the tests: the hub of each test's event loop, closed after it."""

from __future__ import annotations

import os

import pytest

from realtime_app import hub as hub_module


def pytest_configure(config: pytest.Config) -> None:
    # Each run has its own Redis key prefix (scripts/test sets it); a bare pytest run gets one.
    if not os.environ.get("REALTIME_TEST_PREFIX"):
        import secrets

        os.environ["REALTIME_TEST_PREFIX"] = f"rt-test-{secrets.token_hex(4)}"


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis of the live tests (the machine's, or the one scripts/test starts): a
    missing one fails the test, never skips it."""
    import redis

    url = os.environ.get("REALTIME_TEST_REDIS_URL")
    if not url:
        pytest.fail("REALTIME_TEST_REDIS_URL is not set: run the tests with scripts/test (it provides Redis)")
    redis.Redis.from_url(url).ping()
    return url


@pytest.fixture
async def hub():
    """The started hub of this test's loop; closed (tickers cleaned up) after the test."""
    h = await hub_module.get_hub()
    yield h
    await h.aclose()


@pytest.fixture(scope="session")
def postgres():
    """This run's own PostgreSQL database (migrated, demo users), dropped at the end:
    ``(server_url, database_url)``."""
    from tests.support.postgres import create_database, drop_database, migrate, server_url

    server = server_url()
    name = os.environ["REALTIME_TEST_PREFIX"].replace("-", "_")
    database = create_database(server, name)
    migrate(database)
    yield server, database
    drop_database(server, name)


@pytest.fixture(scope="module")
def database(tmp_path_factory):
    """A migrated SQLite database of the demo site (users demo and admin) for the servers
    of one test module: ``{"DATABASE_URL": ...}`` to merge into their environment."""
    from tests.support.servers import prepare_database

    return prepare_database(str(tmp_path_factory.mktemp("db") / "db.sqlite3"))


@pytest.fixture
def private_redis():
    """A ``redis-server`` of this test's own, on a free port: the one a fault test may
    kill, pause or flush (never the machine's)."""
    from tests.support.private_redis import PrivateRedis

    server = PrivateRedis().start()
    yield server
    server.close()
