"""A thread of one's own whose database connections stay open between calls.

Why: the outbox drain asks its databases something every beat (a second by default), in
every process. Through ``database_sync_to_async`` each call ends with
``close_old_connections``, which under Django's default ``CONN_MAX_AGE = 0`` closes the
connection: every process opened and closed a connection each second — on PostgreSQL a
server backend started per beat, on SQLite a third of an idle process's CPU.

The thread keeps what it opened — one connection per database, Django's connections being
per thread. A call that fails on a connection kept from before, with the database's own
error (a restart, a terminated backend, a pooler's reconnect), is made once more on a
fresh one; any other failure closes that database's connection, and the next call
connects again. The owner's :meth:`ConnectionThread.aclose` closes them all, after a call
under way (or, dropped unclosed, its finalizer without waiting). The thread is made at the
first call: an owner cancelled before it asked anything holds nothing.

An in-memory SQLite database (a test run's), or one in SQLite's shared-cache mode, is the
exception: there a read in one thread makes another's write fail at once ("database table
is locked") instead of waiting, so its calls go through the one thread Django's sync code
shares (``database_sync_to_async``), one after the other, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["CLOSE_WAIT_S", "ConnectionThread", "shared_cache"]

logger = logging.getLogger("realtime_app.persistence")

T = TypeVar("T")

#: How long :meth:`ConnectionThread.aclose` waits for a call under way to end before it
#: leaves the close queued behind it (a database that does not answer).
CLOSE_WAIT_S = 5.0


def shared_cache(alias: str) -> bool:
    """True for an SQLite database whose connections share one cache: in memory (Django's
    test database, ``:memory:``, ``mode=memory``) or ``cache=shared``."""
    from django.db import connections

    connection = connections[alias]  # a wrapper for this thread; nothing is opened
    if connection.vendor != "sqlite":
        return False
    return bool(connection.is_in_memory_db()) or "cache=shared" in str(connection.settings_dict["NAME"])


def _close(alias: str | None = None) -> None:
    """This thread's connection to ``alias`` (every one of them: None), whatever its state."""
    from django.db import connections

    chosen = connections.all(initialized_only=True) if alias is None else [connections[alias]]
    for connection in chosen:
        try:
            connection.close()
        except Exception:  # a connection already broken: nothing left to release
            logger.debug("closing %s's connection failed", connection.alias, exc_info=True)


def _call_holding(alias: str, fn: Callable[..., T], *args: object) -> T:
    from django.db import InterfaceError, OperationalError, connections

    kept = connections[alias].connection is not None
    try:
        return fn(alias, *args)
    except (InterfaceError, OperationalError) as exc:
        _close(alias)
        if not kept:
            raise
        logger.debug("%s: the kept connection failed (%s); once more on a fresh one", alias, exc)
    except BaseException:
        _close(alias)
        raise
    try:
        return fn(alias, *args)
    except BaseException:
        _close(alias)
        raise


class _Thread:
    """The executor, and whether it was asked anything (then it has a thread)."""

    def __init__(self, name: str) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name)  # no thread before a call
        self.asked = False


def _release(thread: _Thread) -> Any:
    """Queue the close of the thread's connections and let the thread end (no wait)."""
    if not thread.asked:
        thread.executor.shutdown(wait=False)
        return None
    try:
        closing = thread.executor.submit(_close)
    except RuntimeError:  # the interpreter shuts down: its threads and connections go with it
        return None
    thread.executor.shutdown(wait=False)
    return closing


class ConnectionThread:
    """One thread (made at the first call) and the connections it opened."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._thread = _Thread(name)
        self._release = weakref.finalize(self, _release, self._thread)

    @property
    def closed(self) -> bool:
        return not self._release.alive

    async def call(self, alias: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(alias, *args)`` in the thread, on its open connection to database ``alias``."""
        if self.closed:
            raise RuntimeError(f"{self.name}: closed")
        if shared_cache(alias):
            from channels.db import database_sync_to_async

            return await database_sync_to_async(fn)(alias, *args)  # type: ignore[no-any-return]
        self._thread.asked = True
        return await asyncio.get_running_loop().run_in_executor(self._thread.executor, _call_holding, alias, fn, *args)

    async def aclose(self) -> None:
        """Close the thread's connections, after a call under way (waiting up to
        ``CLOSE_WAIT_S`` for it; past that the close stays queued behind it), and let the
        thread end. Again: nothing."""
        closing = self._release()
        if closing is not None:
            with contextlib.suppress(TimeoutError):  # shielded: a timeout leaves the close queued
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(closing)), CLOSE_WAIT_S)
