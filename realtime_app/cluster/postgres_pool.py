"""The PostgreSQL backplane's connections: where the database is (a Django database alias,
``BACKPLANE_DATABASE``), and a small pool of its own, bounded by ``POSTGRES_POOL_SIZE``.

Django's own connections are sync, per thread, and may be pooled or persistent
(``CONN_MAX_AGE``): the backplane never borrows them. Its connections are asyncio ones
(psycopg 3), in autocommit, with ``synchronous_commit`` off — a publication waits for no
disk flush; a crash of the server may lose its last few hundred milliseconds, which the
epoch of a history says (:mod:`realtime_app.cluster.postgres_sql`) — and every call is
bounded by ``POSTGRES_TIMEOUT_MS``: a server that stops answering fails calls, and the
connection it held is closed rather than reused in an unknown state.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from collections.abc import AsyncIterator
from typing import Any

import psycopg

from realtime_app.cancellation import uninterrupted

__all__ = ["DJANGO_ONLY_OPTIONS", "MIGRATE_HINT", "Pool", "TablesMissing", "connection_params", "label"]

#: What to do when the database has no backplane tables or functions.
MIGRATE_HINT = "run manage.py migrate (with --database for a BACKPLANE_DATABASE other than 'default')"


class TablesMissing(psycopg.OperationalError):
    """The database has no backplane tables: ``manage.py migrate`` was not run on it (or
    was rolled back)."""


#: Keys of a Django database's ``OPTIONS`` that are Django's, not libpq's.
DJANGO_ONLY_OPTIONS = frozenset(
    {"pool", "server_side_binding", "isolation_level", "assume_role", "cursor_factory", "context", "prepare_threshold"}
)


def connection_params(config: dict[str, Any]) -> dict[str, Any]:
    """libpq keywords for the backplane's connections, from the Django database
    ``BACKPLANE_DATABASE`` (its test database's name while tests run)."""
    from django.db import connections

    db = connections[config["BACKPLANE_DATABASE"]].settings_dict
    params: dict[str, Any] = {
        key: value
        for key, value in (db.get("OPTIONS") or {}).items()
        if key not in DJANGO_ONLY_OPTIONS and value is not None
    }
    for key, name in (("dbname", "NAME"), ("user", "USER"), ("password", "PASSWORD"), ("host", "HOST")):
        if db.get(name):
            params[key] = db[name]
    if db.get("PORT"):
        params["port"] = int(db["PORT"])
    return params


def label(params: dict[str, Any]) -> str:
    """Where the database is, for logs and the probe (no password)."""
    if "conninfo" in params:
        info = psycopg.conninfo.conninfo_to_dict(params["conninfo"])
        params = {**info, **params}
    return f"{params.get('host') or 'localhost'}:{params.get('port') or 5432}/{params.get('dbname') or ''}"


class Pool:
    """At most ``size`` connections, opened as needed, each used by one call at a time; a
    call waits for a free one at most ``timeout_s`` (then :class:`TimeoutError`)."""

    def __init__(self, params: dict[str, Any], size: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.size = size
        # idle_session_timeout off: a pooled or listening connection idles on purpose (a
        # managed database's 3 s ended them all, and each end lost the notifications under way)
        ours = f"-c synchronous_commit=off -c statement_timeout={int(timeout_s * 1000)} -c idle_session_timeout=0"
        options = " ".join(filter(None, [params.get("options"), ours]))
        self.params = {
            "application_name": "realtime_app backplane",
            **params,
            "options": options,
            "autocommit": True,
            "connect_timeout": max(1, int(timeout_s)),
        }
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._slots: asyncio.Semaphore | None = None
        self.closed = False

    async def connect(self) -> psycopg.AsyncConnection[Any]:
        """A new connection with the pool's settings (the listener's too)."""
        if self.closed:
            raise psycopg.OperationalError("the backplane was stopped")
        async with asyncio.timeout(self.timeout_s):
            return await psycopg.AsyncConnection.connect(**self.params)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection for one call: back to the pool after, closed after any failure."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        async with asyncio.timeout(self.timeout_s):
            await self._slots.acquire()
        conn = None
        try:
            while self._idle and stale(self._idle[-1]):
                await discard(self._idle.pop())
            conn = self._idle.pop() if self._idle else await self.connect()
            yield conn
        except BaseException:
            if conn is not None:  # its state is unknown (a cancel mid-query, a cut socket)
                await discard(conn)
                conn = None
            raise
        finally:
            if conn is not None:
                if self.closed or conn.closed:
                    await discard(conn)
                else:
                    self._idle.append(conn)
            self._slots.release()

    async def run(self, query: Any, params: Any = None) -> None:
        """Run ``query`` (no rows), within the timeout."""
        await self._execute(query, params, None)

    async def one(self, query: Any, params: Any = None) -> Any:
        """The first row of ``query``, within the timeout."""
        return await self._execute(query, params, "one")

    async def all(self, query: Any, params: Any = None) -> list[Any]:
        """Every row of ``query``, within the timeout."""
        rows: list[Any] = await self._execute(query, params, "all")
        return rows

    async def _execute(self, query: Any, params: Any, fetch: str | None) -> Any:
        try:
            async with self.connection() as conn:
                async with asyncio.timeout(self.timeout_s):
                    cursor = await conn.execute(query, params)
                    if fetch == "one":
                        return await cursor.fetchone()
                    return await cursor.fetchall() if fetch == "all" else None
        except (psycopg.errors.UndefinedFunction, psycopg.errors.UndefinedTable) as exc:
            raise TablesMissing(f"the backplane's tables or functions are missing ({exc}): {MIGRATE_HINT}") from exc

    async def close(self) -> None:
        """Close every idle connection; one in use is closed when its call ends."""
        self.closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await discard(conn)


def stale(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether an idle connection is closed or has something to read — an idle one is sent
    nothing unless the server ended it (a restart's "terminating connection", a cut): taken
    from the pool, its first call would fail. Costs no round trip."""
    if conn.closed or conn.broken:
        return True
    poller = select.poll()  # not select(): a process with 1,024 sockets has descriptors past it
    try:
        poller.register(conn.fileno(), select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


async def discard(conn: psycopg.AsyncConnection[Any]) -> None:
    """Close ``conn`` to the end, whatever the caller hears meanwhile."""
    with contextlib.suppress(psycopg.Error, OSError):
        await uninterrupted(conn.close())
