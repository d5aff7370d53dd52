"""A thread of one's own whose database connections stay open between calls.

Why: the outbox drain asks its databases something every beat (a second by default), in
every process. Through ``database_sync_to_async`` each call ends with
``close_old_connections``, which under Django's default ``CONN_MAX_AGE = 0`` closes the
connection: every process opened and closed a connection each second — on SQLite a
quarter of an idle process's CPU, on PostgreSQL a server backend started per beat.

The thread keeps what it opened — one connection per database, Django's connections being
per thread — and closes it after an error (the next call connects again: a database that
restarted is met with a fresh connection) and when its owner closes it. A thread is made
at the first call, not before: an owner cancelled before it asked anything holds nothing.

An in-memory SQLite database (a test run's) is the exception: its connections share one
cache, where a read in one thread makes another's write fail at once ("database table is
locked") instead of waiting — so its calls go through the one thread Django's sync code
shares (``database_sync_to_async``), one after the other, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

__all__ = ["ConnectionThread"]

logger = logging.getLogger("realtime_app.persistence")

T = TypeVar("T")


def _close_connections() -> None:
    """This thread's connections (Django's are per thread), whatever their state."""
    from django.db import connections

    for connection in connections.all(initialized_only=True):
        try:
            connection.close()
        except Exception:  # a connection already broken: nothing left to release
            logger.debug("closing %s's connection failed", connection.alias, exc_info=True)


def _shared_cache(alias: str) -> bool:
    from django.db import connections
    from django.db.backends.sqlite3.creation import DatabaseCreation

    settings = connections.settings[alias]
    return "sqlite3" in str(settings["ENGINE"]) and DatabaseCreation.is_in_memory_db(settings["NAME"])


def _call_holding(fn: Callable[..., T], *args: object) -> T:
    try:
        return fn(*args)
    except BaseException:
        _close_connections()  # connected again at the next call
        raise


class ConnectionThread:
    """One thread (made at the first call) and the connections it opened."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._executor: ThreadPoolExecutor | None = None
        self.closed = False

    async def call(self, alias: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``, which uses database ``alias``, in the thread on its open connection."""
        if self.closed:
            raise RuntimeError(f"{self.name}: closed")
        if _shared_cache(alias):
            from channels.db import database_sync_to_async

            return await database_sync_to_async(fn)(*args)  # type: ignore[no-any-return]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.name)
        return await asyncio.get_running_loop().run_in_executor(self._executor, _call_holding, fn, *args)

    def close(self) -> None:
        """Close the thread's connections (after a call under way, in the thread) and let
        the thread end; without waiting, so that it can run in a cancelled task's
        ``finally``. Again: nothing."""
        self.closed = True
        executor, self._executor = self._executor, None
        if executor is None:
            return
        executor.submit(_close_connections)
        executor.shutdown(wait=False)
