"""The outbox drain's database thread (realtime_app.persistence.connection_thread): its
connection kept between beats, let go after an error and when its owner closes it."""

from __future__ import annotations

import pytest

from tests.support.waiting import eventually


async def test_the_drains_database_thread_keeps_its_connection_and_lets_go_after_an_error_and_when_closed(
    tmp_path, django_db_blocker
):
    """The outbox drain asks its database each beat through a thread of its own, on a
    connection kept open between calls whatever ``CONN_MAX_AGE`` says (the default 0 here):
    closed after an error (the next call connects again) and when the drain closes the
    thread, which then ends. (An in-memory SQLite database goes through Django's shared
    sync thread instead; this one is a file, as a site's is.)"""
    import threading

    from django.db import OperationalError, connections

    from realtime_app.persistence.connection_thread import ConnectionThread

    alias = "drain_file"
    settings = {"default": {}, alias: {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "site.sqlite3")}}
    connections.settings[alias] = connections.configure_settings(settings)[alias]  # its defaults: CONN_MAX_AGE 0

    def connected(alias: str) -> tuple[object, object, threading.Thread]:
        wrapper = connections[alias]
        wrapper.ensure_connection()
        return wrapper, wrapper.connection, threading.current_thread()

    def fails(alias: str) -> None:
        connections[alias].cursor().execute("SELECT * FROM nowhere")

    thread = ConnectionThread("rt-test-drain-db")
    with django_db_blocker.unblock():
        try:
            wrapper, first, worker = await thread.call(alias, connected)
            assert worker is not threading.current_thread()
            assert (await thread.call(alias, connected))[1:] == (first, worker)  # kept between calls
            with pytest.raises(OperationalError):
                await thread.call(alias, fails)
            assert wrapper.connection is None  # closed after the error
            _, again, same = await thread.call(alias, connected)
            assert again is not first and same is worker
            await thread.aclose()
            await eventually(lambda: not worker.is_alive(), 10, "the thread ended")
            assert wrapper.connection is None
            with pytest.raises(RuntimeError):
                await thread.call(alias, connected)
        finally:
            await thread.aclose()
            del connections.settings[alias]
            del connections[alias]


@pytest.mark.parametrize(
    ("engine", "name", "shared"),
    [
        ("sqlite3", "file:memorydb_default?mode=memory&cache=shared", True),  # Django's test database
        ("sqlite3", ":memory:", True),
        ("sqlite3", "file:site.sqlite3?cache=shared", True),
        ("sqlite3", "site.sqlite3", False),
        ("postgresql", "site", False),
    ],
)
def test_only_a_database_whose_connections_share_one_cache_goes_through_djangos_shared_thread(engine, name, shared):
    from django.db import connections

    from realtime_app.persistence.connection_thread import shared_cache

    alias = "drain_kind"
    settings = {"default": {}, alias: {"ENGINE": f"django.db.backends.{engine}", "NAME": name}}
    connections.settings[alias] = connections.configure_settings(settings)[alias]
    try:
        assert shared_cache(alias) is shared
    finally:
        del connections.settings[alias]
        del connections[alias]


async def test_a_thread_closed_before_its_first_call_never_ran():
    """Cancelled before its first step, an owner holds nothing: no thread was made."""
    import threading

    from realtime_app.persistence.connection_thread import ConnectionThread

    thread = ConnectionThread("rt-test-never-called")
    await thread.aclose()
    await thread.aclose()  # again: nothing
    assert thread.closed
    assert not [t for t in threading.enumerate() if t.name.startswith("rt-test-never-called")]
