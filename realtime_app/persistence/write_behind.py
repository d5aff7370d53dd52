"""Write-behind persistence: state accepted in memory at once, made durable in batches.

A :class:`WriteBehindStore` keeps the objects of one Django model in memory, keyed by
their natural key. ``mutate`` changes the state and returns at once — **accepted** — with
a handle whose ``durable`` completes once a flush has written that version — **durable**.
One flush loop per process writes what has been dirty for ``WRITE_BEHIND_DELAY_MS``, in
batches (docs/write-behind.md):

* **counters** (fields declared ``counters=``) are written as deltas, ``F(field) + n``,
  one ``UPDATE … CASE`` per batch: commutative, so two processes changing the same
  counter both land (the sum is exact), and nothing else is read first;
* the other changed fields are upserted (``bulk_create(update_conflicts=True)``) —
  only the fields this process changed since its last flush, so it never writes back a
  stale value of a field it did not touch;
* deletes go in batches of 200.

A flush writes the state it took: a mutation arriving during it keeps the object dirty
(per-object versions), so an older state never overwrites a newer one. Transient database
errors are retried up to 3 times, then the flush backs off exponentially (capped at 30 s,
jittered) — nothing is dropped. A batch the database refuses for a reason that is not an
outage (a constraint, a row that is gone and may not be made) is split until the objects
at fault stand alone: the others are written; those are **refused** — reported once at
ERROR, counted, their unsaved changes dropped (their ``durable()`` raises
:class:`WriteRefused`) and read again from the database at their next use. Neither retried
forever nor journaled: the journal holds only what an outage left unsaved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

from django.db import models

from realtime_app.observability.schema import StoreProbe
from realtime_app.persistence import lifecycle
from realtime_app.persistence.batches import BatchWriter, absent
from realtime_app.persistence.entries import (
    Accepted,
    Batch,
    Entry,
    Key,
    WriteRefused,
    evictable,
    snapshot,
)
from realtime_app.persistence.handover import Handover
from realtime_app.persistence.lifecycle import (
    flush_all,
    install_shutdown_flush,
    start_all,
    store_probe,
    stores,
    stores_probe,
)
from realtime_app.persistence.sql import Create, Table, required_fields

__all__ = [
    "Accepted",
    "WriteBehindStore",
    "WriteRefused",
    "flush_all",
    "install_shutdown_flush",
    "start_all",
    "stores",
    "stores_probe",
]

logger = logging.getLogger("realtime_app.write_behind")

M = TypeVar("M", bound=models.Model)


class WriteBehindStore(BatchWriter, Generic[M]):
    """Objects of ``model`` keyed by the fields ``key``, persisted behind the hot path.

    Args:
        model: a Django model with a unique constraint (or ``unique_together``) on ``key``.
        key: the natural key's field names (``("user_id", "item")``).
        fields: the persisted fields (besides the key).
        counters: the fields among ``fields`` that only ever change by adding (shots fired,
            likes): flushed as commutative deltas, safe across processes.
        defaults: ``defaults(key) -> {field: value}`` for an object not in the database.
        create: how a row that does not exist is made. ``True`` (the default): from the
            key, the store's fields and the model's own defaults — a model with another
            required field is check error ``realtime_app.E030``; a callable
            ``create(key) -> {field: value}`` gives the other fields a new row needs
            (``{"ends_at": ...}``); ``False``: rows are never made here, an object whose
            row does not exist is refused.
        delay_s: how long a change stays in memory before it may be written
            (default ``WRITE_BEHIND_DELAY_MS``).
        name: the store's name in the probe and its journal (default: the model's label).
        max_objects: objects kept in memory; past it the least recently used saved ones
            are forgotten (read again from the database when next used).
    """

    def __init__(
        self,
        model: type[M],
        *,
        key: Iterable[str],
        fields: Iterable[str],
        counters: Iterable[str] = (),
        defaults: Callable[[Key], dict[str, Any]] | None = None,
        create: Create = True,
        delay_s: float | None = None,
        name: str | None = None,
        max_objects: int = 10_000,
    ) -> None:
        self.model = model
        self.key_fields = tuple(key)
        self.fields = tuple(fields)
        self.counters = frozenset(counters)
        if not self.counters <= set(self.fields):
            raise ValueError("counters must be among fields")
        self.defaults = defaults or (lambda key: {})
        self._delay_s = delay_s
        self.name = name or model._meta.label
        self.entries: dict[Key, Entry] = {}
        self._loading: dict[Key, asyncio.Future[Entry]] = {}
        self._flush_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._inline = False  # write in the calling thread (the end of the process)
        self._in_doubt: list[tuple[str, Batch]] = []  # batches whose outcome is not known yet
        if max_objects < 1:
            raise ValueError("max_objects must be >= 1")
        self.max_objects = max_objects  # objects kept in memory; the least recently used clean ones go
        self._journal_checked = False
        self._refreshed_at = time.monotonic()  # counters read back without a write of ours
        self.evicted = 0
        # the probe
        self.flushed_rows = 0
        self.flushed_deletes = 0
        self.flushes = 0
        self.retries = 0
        self.consecutive_failures = 0
        self.last_flush: dict[str, Any] | None = None
        self.failing: dict[str, str] = {}  # key -> why the database refused it (the latest 10)
        self.refused = 0  # objects whose unsaved changes the database refused
        self.create = create
        self.table = Table(model, self.key_fields, self.fields, self.counters, create)
        self.handover = Handover(self.name, self.table)  # the journals taken over, and what this one hands over
        lifecycle.register(self)

    @property
    def delay_s(self) -> float:
        if self._delay_s is not None:
            return self._delay_s
        from realtime_app.conf.runtime import settings

        return float(settings().write_behind_delay_ms) / 1000

    # -- reading ------------------------------------------------------------------------

    def _key(self, key: Hashable) -> Key:
        return key if isinstance(key, tuple) else (key,)

    async def get(self, key: Hashable) -> dict[str, Any] | None:
        """The object's state (loaded from the database on first access); None if deleted."""
        entry = await self._entry(self._key(key))
        return None if entry.state is None else dict(entry.state)

    async def _entry(self, key: Key) -> Entry:
        self._start()
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.entries[key] = entry  # the most recently used last: eviction starts at the front
            if entry.stale:
                await self._reload(key, entry)
            return entry
        loading = self._loading.get(key)
        if loading is None:  # one read per key, however many ask at once, in a task of its own:
            loading = asyncio.get_running_loop().create_task(self._load_into(key))  # a caller that is
            self._loading[key] = loading  # cancelled does not cancel the others' load
        return await asyncio.shield(loading)

    async def _load_into(self, key: Key) -> Entry:
        try:
            entry = await self._load(key)
            entry = self.entries.setdefault(key, entry)
            self._evict(keep=key)  # never the one its caller is about to change
            if self._wake is not None:  # the loop reads it back on its beat, if only read here
                self._wake.set()
            return entry
        finally:
            self._loading.pop(key, None)

    def _evict(self, keep: Key | None = None) -> None:
        """Forget the least recently used saved objects while over ``max_objects``."""
        gone = evictable(self.entries, len(self.entries) - self.max_objects, keep)
        for key in gone:
            del self.entries[key]
        self.evicted += len(gone)

    async def preload(self, keys: Iterable[Hashable]) -> int:
        """Load many objects at once (one query per 500), so that their first mutation
        reads nothing; returns how many were not loaded yet."""
        from channels.db import database_sync_to_async

        self._start()
        missing = [k for k in dict.fromkeys(self._key(key) for key in keys) if k not in self.entries]

        for i in range(0, len(missing), 500):
            chunk = missing[i : i + 500]
            found = await database_sync_to_async(self.table.read)(chunk)
            for key in chunk:
                if key in self.entries:
                    continue
                if key in found:
                    self.entries[key] = Entry(state=found[key], in_db=True, durable=dict(found[key]))
                else:
                    self.entries[key] = Entry(
                        state={**{f: None for f in self.fields}, **self.defaults(key)}, in_db=False
                    )
        self._evict()
        if self._wake is not None:
            self._wake.set()
        return len(missing)

    async def _reload(self, key: Key, entry: Entry) -> None:
        """A refused object: what the database holds replaces what was refused."""
        fresh = await self._load(key)
        if entry.stale and entry.dirty_since is None and not entry.in_doubt:
            entry.state, entry.in_db, entry.durable, entry.stale = fresh.state, fresh.in_db, fresh.durable, False
            entry.error = None  # what the database holds now: it may be forgotten like any saved object

    async def _load(self, key: Key) -> Entry:
        from channels.db import database_sync_to_async

        found = (await database_sync_to_async(self.table.read)([key])).get(key)
        if found is not None:
            return Entry(state=found, in_db=True, durable=dict(found))
        return Entry(state={**{f: None for f in self.fields}, **self.defaults(key)}, in_db=False)

    def durable(self, key: Hashable) -> tuple[dict[str, Any] | None, float | None]:
        """What the database holds for ``key`` as this process last read or wrote it, and
        when it last wrote it (wall time; None: not since it started). Loaded keys only."""
        entry = self.entries.get(self._key(key))
        if entry is None:
            return None, None
        return (None if entry.durable is None else dict(entry.durable)), entry.saved_at

    def unsaved(self, key: Hashable) -> bool:
        """True while ``key`` has a change that no flush has written yet."""
        entry = self.entries.get(self._key(key))
        return entry is not None and entry.dirty_since is not None

    # -- changing -----------------------------------------------------------------------

    async def mutate(self, key: Hashable, change: Callable[[dict[str, Any]], Any] | dict[str, Any]) -> Accepted:
        """Apply ``change`` (a dict of new values, or a function that edits the state in
        place) and return at once: the mutation is **accepted**; ``durable()`` follows."""
        k = self._key(key)
        entry = await self._entry(k)
        state = entry.state if entry.state is not None else {**{f: None for f in self.fields}, **self.defaults(k)}
        new = dict(state)
        if callable(change):
            change(new)
        else:
            new.update(change)
        unknown = set(new) - set(self.fields)
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)} for store {self.name}")
        entry.version += 1
        for name in self.fields:
            if new[name] == state.get(name) and entry.state is not None:
                continue
            if name in self.counters:
                entry.deltas[name] = entry.deltas.get(name, 0) + (new[name] or 0) - (state.get(name) or 0)
            else:
                entry.changed[name] = entry.version
        if entry.state is None:  # re-created after a delete: every field is written
            entry.changed.update({name: entry.version for name in self.fields if name not in self.counters})
        entry.state = new
        self._dirty(entry)
        return Accepted(dict(new), entry.version, self, k)

    async def add(self, key: Hashable, counter: str, n: int | float) -> Accepted:
        """Add ``n`` to a counter (negative to take): the commutative mutation."""
        if counter not in self.counters:
            raise ValueError(f"{counter!r} is not a counter of store {self.name}")
        return await self.mutate(key, lambda state: state.__setitem__(counter, (state[counter] or 0) + n))

    async def delete(self, key: Hashable) -> Accepted:
        """Delete the object (in memory now, in the database at the next flush)."""
        k = self._key(key)
        entry = await self._entry(k)
        entry.version += 1
        entry.state = None
        entry.deltas.clear()
        entry.changed.clear()
        entry.generation += 1
        entry.replace = True  # whatever comes next replaces the row as a whole
        self._dirty(entry)
        return Accepted(None, entry.version, self, k)

    def _dirty(self, entry: Entry) -> None:
        if entry.dirty_since is None:
            entry.dirty_since = time.monotonic()
        if self._wake is not None:
            self._wake.set()

    async def _durable(self, key: Key, version: int) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.refused is not None and entry.refused[0] < version <= entry.refused[1]:
            raise WriteRefused(self.name, key, entry.refused[2])
        if entry is None or entry.flushed >= version:  # forgotten: only saved objects are
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry.waiters.append((version, future))
        await future

    # -- the flush loop -----------------------------------------------------------------

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done() and self._loop is loop:
            return
        self._loop = loop
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        if not self._journal_checked:
            self._journal_checked = True
            self.handover.take_over(self.entries, self._in_doubt, self.delay_s)
        self._task = loop.create_task(self._run(), name=f"write-behind {self.name}")
        install_shutdown_flush()

    def start(self) -> None:
        """Start the flush loop now (on the running loop), taking over the journals that
        ended processes left; otherwise it starts at the store's first use."""
        self._start()

    def journal_unsaved(self) -> int:
        """The process is ending: journal what is still unsaved for the next process
        (:meth:`~realtime_app.persistence.handover.Handover.hand_over`)."""
        return self.handover.hand_over(self.entries, self._in_doubt)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            due = self._next_due()
            if due is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            wait = due - time.monotonic()
            if wait > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):  # not wait_for: it may swallow a cancel (3.11)
                        await self._wake.wait()
                continue
            try:
                await self.flush()
            except Exception:  # flush() keeps the work and schedules the retry itself
                logger.exception("store %s: flush failed", self.name)

    def _next_due(self) -> float | None:
        due: float | None = None
        delay = self.delay_s
        readable = False  # an object whose counters can be read back, or whose row may appear
        for entry in self.entries.values():
            readable = readable or (entry.in_db and not entry.in_doubt and bool(self.counters)) or absent(entry)
            if entry.dirty_since is None:
                continue
            when = max(entry.dirty_since + delay, entry.not_before)
            due = when if due is None else min(due, when)
        if readable:  # and the others' deltas, read back (never more than once a second)
            due = min(due or float("inf"), self._refreshed_at + max(delay, 1.0))
        return due

    async def flush(self, *, everything: bool = False) -> int:
        """Write what is due (``everything``: all that is dirty, as at shutdown). One flush at
        a time per store; returns the objects written."""
        async with self._flush_lock:
            started = time.monotonic()
            written, failed = await self._settle_in_doubt(everything)
            now = time.monotonic()
            delay = 0.0 if everything else self.delay_s
            due = [
                (key, entry)
                for key, entry in self.entries.items()
                if entry.dirty_since is not None
                and not entry.in_doubt
                and (everything or (entry.dirty_since + delay <= now and entry.not_before <= now))
            ]
            refresh = not everything and now >= self._refreshed_at + max(delay, 1.0)
            if not due and not written and not failed:
                self.handover.settle(self._in_doubt)
                if refresh:
                    await self._refresh_counters()
                return 0
            snapshots = [(key, entry, snapshot(entry)) for key, entry in due]
            more, more_failed = await self._write(snapshots)
            written, failed = written + more, failed + more_failed
            self.handover.settle(self._in_doubt)
            if refresh:  # after the writes: what is due is not held up by the reads
                await self._refresh_counters()
            duration = time.monotonic() - started
            self.flushes += 1
            self.last_flush = {
                "at": time.time(),
                "rows": written,
                "duration_ms": round(duration * 1000, 1),
                "failed": failed,
            }
            return written

    def problems(self) -> list[str]:
        """What keeps this store from making the rows it may need (check E030)."""
        if self.create is not True:
            return []
        missing = required_fields(self.model, {*self.key_fields, *self.fields})
        if not missing:
            return []
        return [
            f"write-behind store {self.name!r} cannot create a {self.model._meta.label} row: "
            f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} no default"
        ]

    # -- shutdown and probe -------------------------------------------------------------

    def close(self) -> None:
        """Forget this store: its loop stops and it is no longer flushed at shutdown or
        listed in the probe. What is unsaved is dropped — flush first to keep it."""
        if self._task is not None and not self._task.done() and self._loop is not None and not self._loop.is_closed():
            self._task.cancel()
        lifecycle.unregister(self)

    async def aflush_all(self) -> int:
        """Write everything dirty now (shutdown), retrying transient errors."""
        return await self.flush(everything=True)

    @property
    def in_doubt_rows(self) -> int:
        """Rows of batches whose outcome is not known yet (the probe's ``in_doubt``)."""
        return sum(len(batch) for _, batch in self._in_doubt)

    def for_exit(self) -> None:
        """The process ends without a server (a command, a script): a lock of the exit's own
        loop, and writes in the calling thread (threads can no longer be started)."""
        self._flush_lock = asyncio.Lock()
        self._inline = True

    def probe(self) -> StoreProbe:
        """This store's counters (the probe's ``write_behind``)."""
        return store_probe(self)
