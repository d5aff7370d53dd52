"""The model's table as a write-behind store sees it: reads, and batch writes in one
transaction each under the batch's token (runs in a worker thread; docs/write-behind.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Generic, TypeVar

from django.core.exceptions import ValidationError
from django.db import DatabaseError, DataError, IntegrityError, InterfaceError, OperationalError, models, transaction
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from realtime_app.conf.runtime import runtime
from realtime_app.persistence.entries import Batch, Key

__all__ = ["Create", "MarksSwept", "Permanent", "Refused", "Table", "required_fields", "transient"]

M = TypeVar("M", bound=models.Model)

#: PostgreSQL SQLSTATEs worth an immediate retry: deadlock, serialization failure.
TRANSIENT_PGCODES = {"40P01", "40001"}

#: How long an ordinary batch's token is kept (a journaled batch's is kept for good).
MARKS_KEPT = timedelta(hours=1)


class MarksSwept:
    """When old flush marks were last deleted (a part of the process's runtime)."""

    def __init__(self) -> None:
        self.at = float("-inf")


#: ``create``: how a store makes a row that does not exist — ``True`` from the key, the
#: store's fields and the model's defaults; a callable ``create(key) -> {field: value}``
#: adds the other fields the row needs; ``False`` never makes one (the object is refused).
Create = Callable[[Key], dict[str, Any]] | bool


class Refused(Exception):
    """The database cannot take this object, and would not later either (no row to update
    and none may be made, a value its field rejects)."""


def required_fields(model: type[models.Model], covered: set[str]) -> list[str]:
    """The fields a new row of ``model`` needs that neither ``covered`` (the key and the
    store's fields) nor the model itself provides: no default, no ``db_default``, not
    nullable, not filled by Django (``auto_now``, an auto primary key) and with no empty
    value Django would write (``""`` for text)."""
    missing = []
    for field in model._meta.concrete_fields:
        if field.name in covered or field.attname in covered:
            continue
        if isinstance(field, models.AutoField | models.BigAutoField | models.SmallAutoField):
            continue
        if field.null or field.has_default() or getattr(field, "has_db_default", lambda: False)():
            continue
        if getattr(field, "auto_now", False) or getattr(field, "auto_now_add", False):
            continue
        if getattr(field, "generated", False) or field.empty_strings_allowed:
            continue
        missing.append(field.name)
    return missing


class Table(Generic[M]):
    """Reads and writes of ``model`` rows keyed by ``key_fields`` (synchronous).

    A row is only ever *updated* with the store's fields (``UPDATE`` by primary key: the
    model's other fields are never needed); a row that does not exist is *inserted* whole,
    as ``create`` says, without ignoring any constraint — so SQLite and PostgreSQL refuse
    the same rows."""

    def __init__(
        self,
        model: type[M],
        key_fields: tuple[str, ...],
        fields: tuple[str, ...],
        counters: frozenset[str],
        create: Create = True,
    ):
        self.model = model
        self.key_fields = key_fields
        self.fields = fields
        self.counters = counters
        self.create = create

    def read(self, keys: list[Key]) -> dict[Key, dict[str, Any]]:
        """The persisted fields of the rows of ``keys`` that exist."""
        rows = self.model._default_manager.filter(self._any(keys)).values(*self.key_fields, *self.fields)
        return {tuple(row[f] for f in self.key_fields): {f: row[f] for f in self.fields} for row in rows}

    def _where(self, key: Key) -> Q:
        return Q(**dict(zip(self.key_fields, key, strict=True)))

    def write_batch(self, batch: Batch, token: str, journaled: bool = False) -> dict[Key, dict[str, Any]]:
        """One batch in one transaction (runs in a worker thread); returns the counters as
        the database holds them now, other processes' deltas included.

        Its first statement writes the batch's token: if that token is there already, the
        batch was committed before (its answer was lost) and nothing is written again.
        ``journaled``: the batch comes from a journal, its token is kept for good.
        """
        manager = self.model._default_manager
        with transaction.atomic():
            if not self._mark(token, journaled):
                if journaled:  # committed before it was journaled: its token is kept for good now
                    from realtime_app.models import FlushMark

                    FlushMark.objects.filter(token=token).update(journaled=True)
                return self.read_counters([key for key, _, snap in batch if snap["state"] is not None])
            self._forget_old_marks()
            deletes = [key for key, _, snap in batch if snap["state"] is None or snap["replace"]]
            if deletes:
                manager.filter(self._any(deletes)).delete()
            upserts = [(key, snap) for key, _, snap in batch if snap["state"] is not None]
            if not upserts:
                return {}
            replaced = [(key, snap) for key, snap in upserts if snap["replace"]]
            kept = [(key, snap) for key, snap in upserts if not snap["replace"]]
            # The rows there are, locked (in one order) until the commit: none is deleted
            # between this read and the updates below.
            pks = self._locked_pks([key for key, _ in kept])
            # Deleted, then created again: the whole row, counters as values. Missing (new,
            # or deleted behind the store's back): the row at its base, the deltas added below.
            theirs = self._insert(
                [(key, snap, False) for key, snap in replaced]
                + [(key, snap, True) for key, snap in kept if key not in pks]
            )
            pks.update(self._locked_pks(theirs))  # made by another process meanwhile: updated like the others
            groups: dict[frozenset[str], list[tuple[Key, dict[str, Any]]]] = {}
            for key, snap in kept:  # only the plain fields each object changed, rows that were there
                names = frozenset(snap["changed"]) - self.counters
                if names and key in pks:
                    groups.setdefault(names, []).append((key, snap))
            pk_name = self.model._meta.pk.attname
            for names, members in sorted(groups.items(), key=lambda group: sorted(group[0])):
                objs = [
                    self.model(**{pk_name: pks[key]}, **{n: snap["state"][n] for n in names}) for key, snap in members
                ]
                manager.bulk_update(objs, sorted(names))
            deltas = [(key, snap["deltas"]) for key, snap in kept if snap["deltas"]]
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

    def decode(self, key: list[Any], snap: dict[str, Any]) -> tuple[Key, dict[str, Any]]:
        """A journaled object back as it was: every value through its model field (a
        ``Decimal`` or a date went out as text); raises on anything that is not."""
        meta = self.model._meta
        if len(key) != len(self.key_fields):
            raise ValueError(f"a key of {len(key)} values, not {len(self.key_fields)}")

        def value(name: str, raw: Any) -> Any:
            return None if raw is None else meta.get_field(name).to_python(raw)

        state = snap["state"]
        if state is not None:
            if set(state) != set(self.fields):
                raise ValueError(f"fields {sorted(state)}, not {sorted(self.fields)}")
            state = {name: value(name, raw) for name, raw in state.items()}
        deltas = snap["deltas"]
        if not set(deltas) <= self.counters or not set(snap["changed"]) <= set(self.fields):
            raise ValueError("deltas or changes of fields the store does not hold")
        return tuple(value(name, raw) for name, raw in zip(self.key_fields, key, strict=True)), {
            "version": int(snap["version"]),
            "state": state,
            "deltas": {name: value(name, raw) for name, raw in deltas.items()},
            "changed": {str(name): int(v) for name, v in snap["changed"].items()},
            "in_db": bool(snap["in_db"]),
            "generation": int(snap["generation"]),
            "replace": bool(snap["replace"]),
        }

    def _locked_pks(self, keys: list[Key]) -> dict[Key, Any]:
        if not keys:
            return {}
        rows = (
            self.model._default_manager.select_for_update()
            .filter(self._any(keys))
            .order_by("pk")
            .values_list("pk", *self.key_fields)
        )
        return {tuple(row[1:]): row[0] for row in rows}

    def _insert(self, rows: list[tuple[Key, dict[str, Any], bool]]) -> list[Key]:
        """Insert the rows that are not there, each as ``create`` allows (in key order: two
        processes inserting the same rows do not deadlock); returns the keys another
        process inserted meanwhile (the changes are written to those rows after, as to
        any other). Any other refusal propagates, naming the object."""
        if not rows:
            return []
        rows = sorted(rows, key=lambda row: repr(row[0]))
        if self.create is False:
            raise Refused(f"{rows[0][0]!r}: no such row, and the store does not create rows (create=False)")
        manager = self.model._default_manager
        instances = [self._instance(key, snap, base=base) for key, snap, base in rows]
        try:
            with transaction.atomic():  # a savepoint: a refusal leaves the batch's transaction usable
                manager.bulk_create(instances)
            return []
        except IntegrityError:
            pass
        theirs = []
        for (key, _, _), instance in zip(rows, instances, strict=True):  # one by one: who is at fault
            try:
                with transaction.atomic():
                    manager.bulk_create([instance])
            except IntegrityError:
                if not self._locked_pks([key]):  # not inserted by another process: refused
                    raise
                theirs.append(key)
        return theirs

    def _mark(self, token: str, journaled: bool = False) -> bool:
        """Write the batch's token; False if it is there already (committed before). On
        PostgreSQL a batch still in flight under that token makes this wait for its end.
        A journaled batch's token is kept for good: a journal put back years later is
        still not applied twice."""
        from django.db import connections, router

        from realtime_app.models import FlushMark

        alias = router.db_for_write(FlushMark)
        connection = connections[alias]
        if connection.vendor in ("postgresql", "sqlite"):  # one statement, no savepoint
            table = connection.ops.quote_name(FlushMark._meta.db_table)
            with connection.cursor() as cursor:
                cursor.execute(
                    f"INSERT INTO {table} (token, created, journaled) VALUES (%s, %s, %s) "
                    "ON CONFLICT (token) DO NOTHING RETURNING token",
                    [token, timezone.now(), journaled],
                )
                return cursor.fetchone() is not None
        try:
            with transaction.atomic(using=alias):
                FlushMark.objects.create(token=token, created=timezone.now(), journaled=journaled)
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
        """Tokens are needed only while a batch may be retried: keep an hour of them (a
        journaled batch's for good)."""
        swept = runtime().part(MarksSwept)
        now = time.monotonic()
        if now - swept.at < 600:
            return
        swept.at = now
        from realtime_app.models import FlushMark

        FlushMark.objects.filter(created__lt=timezone.now() - MARKS_KEPT, journaled=False).delete()

    def _instance(self, key: Key, snap: dict[str, Any], *, base: bool = True) -> M:
        values = {**(self.create(key) if callable(self.create) else {}), **snap["state"]}
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
        except (IntegrityError, DataError, Refused, ValidationError, ValueError, TypeError, ArithmeticError) as exc:
            # a constraint, or a value its field cannot take (raised while the SQL is built,
            # before anything reaches the database): rolled back, and no retry would differ
            raise Permanent(exc) from exc
        except (OperationalError, InterfaceError, DatabaseError) as exc:
            if not transient(exc) or n == retries:
                raise
            retried()
            await asyncio.sleep(0.05 * (2**n))
