"""The outbox of durable channels, in the database: a publication made inside a transaction
is a row written in that transaction, so it exists if and only if the transaction
committed; the drain (:mod:`realtime_app.hub.outbox`) publishes the rows and deletes them.

Rows are read in id order per channel; each is published with its database and id as
its idempotency key, so a drain that ran again after a crash between the publication and
the delete publishes nothing twice. Everything here is synchronous (the drain calls it from
its own thread: :mod:`realtime_app.persistence.connection_thread`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db import DEFAULT_DB_ALIAS, transaction

from realtime_app.conf.runtime import runtime

__all__ = ["Row", "Wakers", "channels_waiting", "delete", "on_written", "read", "stats", "write"]


class Wakers:
    """What to call after a commit wrote rows, one per running drain (a part of the
    process's runtime; committing threads and the loop share it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.wakers: list[Callable[[], None]] = []


@dataclass(frozen=True, slots=True)
class Row:
    id: int
    channel: str
    data: str


def on_written(wake: Callable[[], None]) -> Callable[[], None]:
    """Call ``wake`` (from any thread) after each commit that wrote rows: a drain starts at
    once rather than at its next beat. Returns the function that stops it."""
    book = runtime().part(Wakers)
    with book.lock:
        book.wakers.append(wake)

    def stop() -> None:
        with book.lock:
            if wake in book.wakers:
                book.wakers.remove(wake)

    return stop


def _wake_all() -> None:
    book = runtime().part(Wakers)
    with book.lock:
        wakers = list(book.wakers)
    for wake in wakers:
        wake()


#: The advisory-lock class of the outbox's per-channel locks on PostgreSQL ("RTOB").
LOCK_CLASS = 0x52544F42


def write(channel: str, data_json: str, using: str | None = None) -> None:
    """One row in the current transaction of ``using``; the drains are woken when it commits.

    On PostgreSQL the transaction first takes its channel's advisory lock (released at its
    end): transactions publishing on one channel commit one after the other, so id order
    is commit order and the drain publishes in it."""
    from django.db import connections

    from realtime_app.models import OutboxEntry

    alias = using or DEFAULT_DB_ALIAS
    connection = connections[alias]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [LOCK_CLASS, channel])
    OutboxEntry.objects.using(alias).create(channel=channel, data=data_json)
    transaction.on_commit(_wake_all, using=alias)


def channels_waiting(alias: str, limit: int) -> list[str]:
    """Channels with rows, the one waiting longest first (at most ``limit``).

    Asked every beat by every process: written in SQL, which costs a tenth of the ORM's
    building of the same query each time (the limit in the database's own words)."""
    from django.db import connections

    from realtime_app.models import OutboxEntry

    connection = connections[alias]
    name, meta = connection.ops.quote_name, OutboxEntry._meta
    channel, key = name(meta.get_field("channel").column), name(meta.pk.column)
    limited = connection.ops.limit_offset_sql(None, int(limit))  # LIMIT n, or FETCH FIRST n ROWS ONLY
    sql = f"SELECT {channel} FROM {name(meta.db_table)} GROUP BY {channel} ORDER BY MIN({key}) {limited}"
    with connection.cursor() as cursor:
        cursor.execute(sql)
        return [row[0] for row in cursor.fetchall()]


def read(alias: str, channel: str, limit: int) -> list[Row]:
    """A channel's first rows, in id order."""
    from realtime_app.models import OutboxEntry

    rows = OutboxEntry.objects.using(alias).filter(channel=channel).order_by("id")[:limit]
    return [Row(r.id, r.channel, r.data) for r in rows.only("id", "channel", "data")]


def rows_up_to(alias: str, limit: int) -> int:
    """Rows waiting, counted up to ``limit`` (a bounded count, in the current transaction)."""
    from realtime_app.models import OutboxEntry

    return int(OutboxEntry.objects.using(alias).order_by()[:limit].count())


def delete(alias: str, ids: list[int]) -> None:
    from realtime_app.models import OutboxEntry

    OutboxEntry.objects.using(alias).filter(id__in=ids).delete()


def stats(alias: str) -> tuple[int, datetime | None]:
    """Rows waiting and when the oldest was written."""
    from django.db.models import Count, Min

    from realtime_app.models import OutboxEntry

    got = OutboxEntry.objects.using(alias).aggregate(rows=Count("id"), oldest=Min("created"))
    return int(got["rows"] or 0), got["oldest"]
