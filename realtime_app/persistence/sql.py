"""The model's table as a write-behind store sees it: reads, and batch writes in one
transaction each under the batch's token (runs in a worker thread; docs/write-behind.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Generic, TypeVar

from django.db import DatabaseError, DataError, IntegrityError, InterfaceError, OperationalError, models, transaction
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from realtime_app.persistence.entries import Batch, Key

__all__ = ["Permanent", "Table", "transient"]

M = TypeVar("M", bound=models.Model)

#: PostgreSQL SQLSTATEs worth an immediate retry: deadlock, serialization failure.
TRANSIENT_PGCODES = {"40P01", "40001"}

_marks_swept = float("-inf")  # when old flush marks were last deleted


class Table(Generic[M]):
    """Reads and writes of ``model`` rows keyed by ``key_fields`` (synchronous)."""

    def __init__(self, model: type[M], key_fields: tuple[str, ...], fields: tuple[str, ...], counters: frozenset[str]):
        self.model = model
        self.key_fields = key_fields
        self.fields = fields
        self.counters = counters

    def read(self, keys: list[Key]) -> dict[Key, dict[str, Any]]:
        """The persisted fields of the rows of ``keys`` that exist."""
        rows = self.model._default_manager.filter(self._any(keys)).values(*self.key_fields, *self.fields)
        return {tuple(row[f] for f in self.key_fields): {f: row[f] for f in self.fields} for row in rows}

    def _where(self, key: Key) -> Q:
        return Q(**dict(zip(self.key_fields, key, strict=True)))

    def write_batch(self, batch: Batch, token: str) -> dict[Key, dict[str, Any]]:
        """One batch in one transaction (runs in a worker thread); returns the counters as
        the database holds them now, other processes' deltas included.

        Its first statement writes the batch's token: if that token is there already, the
        batch was committed before (its answer was lost) and nothing is written again.
        """
        manager = self.model._default_manager
        with transaction.atomic():
            if not self._mark(token):
                return self.read_counters([key for key, _, snap in batch if snap["state"] is not None])
            self._forget_old_marks()
            deletes = [key for key, _, snap in batch if snap["state"] is None or snap["replace"]]
            if deletes:
                manager.filter(self._any(deletes)).delete()
            upserts = [(key, snap) for key, _, snap in batch if snap["state"] is not None]
            if not upserts:
                return {}
            replaced = [(key, snap) for key, snap in upserts if snap["replace"]]
            if replaced:  # deleted, then created again: the whole row, counters as values
                manager.bulk_create([self._instance(key, snap, base=False) for key, snap in replaced])
            upserts = [(key, snap) for key, snap in upserts if not snap["replace"]]
            # Every row exists (a new one, or one another process deleted meanwhile), its
            # counters at their base: the state minus what is not yet written.
            manager.bulk_create([self._instance(key, snap) for key, snap in upserts], ignore_conflicts=True)
            groups: dict[frozenset[str], list[tuple[Key, dict[str, Any]]]] = {}
            for key, snap in upserts:  # only the plain fields each object changed
                names = frozenset(snap["changed"]) - self.counters
                if names:
                    groups.setdefault(names, []).append((key, snap))
            for names, members in sorted(groups.items(), key=lambda group: sorted(group[0])):
                manager.bulk_create(
                    [self._instance(key, snap) for key, snap in members],
                    update_conflicts=True,
                    unique_fields=list(self.key_fields),
                    update_fields=sorted(names),
                )
            deltas = [(key, snap["deltas"]) for key, snap in upserts if snap["deltas"]]
            for counter in sorted({name for _, d in deltas for name in d}):
                keys = [key for key, d in deltas if d.get(counter)]
                if not keys:
                    continue
                cases = [When(self._where(key), then=Value(d[counter])) for key, d in deltas if d.get(counter)]
                output = self.model._meta.get_field(counter)
                manager.filter(self._any(keys)).update(
                    **{counter: F(counter) + Case(*cases, default=Value(0), output_field=output)}
                )
            return self.read_counters([key for key, _ in deltas] + [key for key, _ in replaced])

    def _mark(self, token: str) -> bool:
        """Write the batch's token; False if it is there already (committed before). On
        PostgreSQL a batch still in flight under that token makes this wait for its end."""
        from django.db import connections, router

        from realtime_app.models import FlushMark

        alias = router.db_for_write(FlushMark)
        connection = connections[alias]
        if connection.vendor in ("postgresql", "sqlite"):  # one statement, no savepoint
            table = connection.ops.quote_name(FlushMark._meta.db_table)
            with connection.cursor() as cursor:
                cursor.execute(
                    f"INSERT INTO {table} (token, created) VALUES (%s, %s) "
                    "ON CONFLICT (token) DO NOTHING RETURNING token",
                    [token, timezone.now()],
                )
                return cursor.fetchone() is not None
        try:
            with transaction.atomic(using=alias):
                FlushMark.objects.create(token=token, created=timezone.now())
        except IntegrityError:
            return False
        return True

    def _any(self, keys: list[Key]) -> Q:
        where = Q()
        for key in keys:
            where |= self._where(key)
        return where

    async def run(self, method: Callable[..., Any], *args: Any, inline: bool = False) -> Any:
        """``method(*args)`` in Django's worker thread — or right here when the process is
        ending and no thread may be started any more."""
        if inline:
            return method(*args)
        from channels.db import database_sync_to_async

        return await database_sync_to_async(method)(*args)

    def read_counters(self, keys: list[Key]) -> dict[Key, dict[str, Any]]:
        if not self.counters or not keys:
            return {}
        rows = self.model._default_manager.filter(self._any(keys)).values(*self.key_fields, *sorted(self.counters))
        return {tuple(row[f] for f in self.key_fields): row for row in rows}

    def _forget_old_marks(self) -> None:
        """Tokens are needed only while a batch may be retried: keep an hour of them."""
        global _marks_swept
        now = time.monotonic()
        if now - _marks_swept < 600:
            return
        _marks_swept = now
        from realtime_app.models import FlushMark

        FlushMark.objects.filter(created__lt=timezone.now() - timedelta(hours=1)).delete()

    def _instance(self, key: Key, snap: dict[str, Any], *, base: bool = True) -> M:
        values = dict(snap["state"])
        if base:
            for name, delta in snap["deltas"].items():  # the base: the delta is added after
                values[name] = (values[name] or 0) - delta
        instance: M = self.model(**dict(zip(self.key_fields, key, strict=True)), **values)
        return instance


class Permanent(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(cause)
        self.cause = cause


def transient(exc: BaseException) -> bool:
    """A lost connection, a deadlock, a serialization failure: worth trying again."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    cause = exc.__cause__
    code = getattr(cause, "pgcode", None) or getattr(getattr(cause, "diag", None), "sqlstate", None)
    return code in TRANSIENT_PGCODES


async def with_retries(attempt: Callable[[], Any], retries: int, retried: Callable[[], None]) -> Any:
    """``await attempt()``, again up to ``retries`` times after a transient error (with a
    short exponential pause; ``retried()`` counts each); a refusal for good raises
    :class:`Permanent`."""
    for n in range(retries + 1):
        try:
            return await attempt()
        except (IntegrityError, DataError) as exc:
            raise Permanent(exc) from exc
        except (OperationalError, InterfaceError, DatabaseError) as exc:
            if not transient(exc) or n == retries:
                raise
            retried()
            await asyncio.sleep(0.05 * (2**n))
