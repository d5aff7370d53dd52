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
jittered) — nothing is dropped. A batch failing for good is split until the objects at
fault are isolated; those are reported and kept, the others are written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from collections.abc import Callable, Hashable, Iterable
from functools import partial
from typing import Any, Generic, TypeVar

from django.db import DatabaseError, InterfaceError, models

from realtime_app.observability.logsafe import safe
from realtime_app.observability.schema import StoreProbe
from realtime_app.persistence import lifecycle
from realtime_app.persistence.entries import Accepted, Batch, Entry, Key, evictable, refresh, settle, snapshot
from realtime_app.persistence.handover import Handover
from realtime_app.persistence.lifecycle import (
    flush_all,
    install_shutdown_flush,
    start_all,
    store_probe,
    stores,
    stores_probe,
)
from realtime_app.persistence.sql import Permanent, Table, with_retries

__all__ = ["Accepted", "WriteBehindStore", "flush_all", "install_shutdown_flush", "start_all", "stores", "stores_probe"]

logger = logging.getLogger("realtime_app.write_behind")

M = TypeVar("M", bound=models.Model)

UPSERT_BATCH = 50
DELETE_BATCH = 200
RETRIES = 3
MAX_BACKOFF_S = 30.0


class WriteBehindStore(Generic[M]):
    """Objects of ``model`` keyed by the fields ``key``, persisted behind the hot path.

    Args:
        model: a Django model with a unique constraint (or ``unique_together``) on ``key``.
        key: the natural key's field names (``("user_id", "item")``).
        fields: the persisted fields (besides the key).
        counters: the fields among ``fields`` that only ever change by adding (shots fired,
            likes): flushed as commutative deltas, safe across processes.
        defaults: ``defaults(key) -> {field: value}`` for an object not in the database.
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
        self.handover = Handover(self.name)  # the journals taken over, and what this one hands over
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
        self.failing: dict[str, str] = {}  # key -> the permanent error that keeps it unsaved
        self.table = Table(model, self.key_fields, self.fields, self.counters)
        lifecycle.register(self)

    @property
    def delay_s(self) -> float:
        if self._delay_s is not None:
            return self._delay_s
        from realtime_app.conf import get_config

        return float(get_config()["WRITE_BEHIND_DELAY_MS"]) / 1000

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
        return len(missing)

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
        readable = False  # an object whose counters can be read back
        for entry in self.entries.values():
            readable = readable or (entry.in_db and not entry.in_doubt)
            if entry.dirty_since is None:
                continue
            when = max(entry.dirty_since + delay, entry.not_before)
            due = when if due is None else min(due, when)
        if self.counters and readable:  # and the others' deltas, read back (never more than once a second)
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
            refresh = not everything and self.counters and now >= self._refreshed_at + max(delay, 1.0)
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

    async def _write(self, snapshots: Batch) -> tuple[int, int]:
        written = failed = 0
        deletes = [s for s in snapshots if s[2]["state"] is None]
        upserts = [s for s in snapshots if s[2]["state"] is not None]
        batches = [deletes[i : i + DELETE_BATCH] for i in range(0, len(deletes), DELETE_BATCH)]
        batches += [upserts[i : i + UPSERT_BATCH] for i in range(0, len(upserts), UPSERT_BATCH)]
        for batch in batches:
            done, bad = await self._write_one(batch, uuid.uuid4().hex)
            written += done
            failed += bad
        return written, failed  # a success resets the failure count (_written), nothing else

    async def _write_one(self, batch: Batch, token: str) -> tuple[int, int]:
        """Write one batch under its token, retrying; split it if it fails for good.

        The token is written in the batch's transaction: a retry of the same batch finds
        it and settles instead of applying the counter deltas twice (the COMMIT may have
        succeeded when its answer was lost). A batch whose outcome stays unknown is kept
        *in doubt*, whole, and written again under the same token before anything newer.
        """
        for _, entry, _ in batch:
            entry.in_doubt = True
        try:
            write = partial(self.table.run, self.table.write_batch, batch, token, inline=self._inline)
            current = await with_retries(write, RETRIES, self._retried)
        except Permanent as exc:  # rolled back: split until the objects at fault stand alone
            for _, entry, _ in batch:
                entry.in_doubt = False
            if len(batch) == 1:
                self._cannot_save(batch[0], exc)
                return 0, 1
            half = len(batch) // 2
            done_a, bad_a = await self._write_one(batch[:half], uuid.uuid4().hex)
            done_b, bad_b = await self._write_one(batch[half:], uuid.uuid4().hex)
            return done_a + done_b, bad_a + bad_b
        except BaseException as exc:  # unknown outcome (the database went away, a cancel)
            self._in_doubt.append((token, batch))
            if isinstance(exc, Exception):
                self._failed_transiently(batch, exc)
                return 0, len(batch)
            raise
        if self.consecutive_failures:
            logger.info("store %s: flushing again after %d failure(s)", self.name, self.consecutive_failures)
            self.consecutive_failures = 0
        for key, entry, snap in batch:
            if settle(entry, snap, current.get(key), self.counters):
                self.flushed_rows += 1
            else:
                self.flushed_deletes += 1
            self.failing.pop(repr(key), None)
        return len(batch), 0

    async def _settle_in_doubt(self, everything: bool) -> tuple[int, int]:
        """Write the batches whose outcome is unknown again, under their own tokens."""
        written = failed = 0
        now = time.monotonic()
        pending, self._in_doubt = self._in_doubt, []
        for token, batch in pending:
            if not everything and any(entry.not_before > now for _, entry, _ in batch):
                self._in_doubt.append((token, batch))  # backed off: not yet
                continue
            done, bad = await self._write_one(batch, token)
            written += done
            failed += bad
        return written, failed

    def _retried(self) -> None:
        self.retries += 1

    def _cannot_save(self, item: tuple[Key, Entry, dict[str, Any]], exc: Permanent) -> None:
        """The database refuses this object for good: keep it, report it, try it rarely."""
        key, entry, _ = item
        message = f"{type(exc.cause).__name__}: {safe(exc.cause, 200)}"
        if self.failing.get(repr(key)) != message:
            logger.error("store %s: %r cannot be saved, kept in memory: %s", self.name, key, message)
        self.failing[repr(key)] = message
        entry.error = message
        entry.not_before = time.monotonic() + MAX_BACKOFF_S

    async def _refresh_counters(self) -> None:
        """Every delay (a second at least) the counters held are read back, in pages of 500:
        a process that writes nothing still sees the others' deltas within the delay plus
        one flush. An entry evicted and loaded again meanwhile is left as loaded."""
        self._refreshed_at = time.monotonic()
        held = [(key, entry) for key, entry in self.entries.items() if entry.in_db and not entry.in_doubt]
        for page in (dict(held[i : i + 500]) for i in range(0, len(held), 500)):
            try:  # an outage is reported by the writes; this waits for its next turn
                rows = await self.table.run(self.table.read_counters, list(page))
            except (DatabaseError, InterfaceError) as exc:
                return logger.debug("store %s: counters not read back: %s", self.name, safe(exc, 200))
            for key, row in rows.items():
                if self.entries.get(key) is page.get(key):
                    refresh(page[key], row, self.counters)

    def _failed_transiently(self, batch: list[tuple[Key, Entry, dict[str, Any]]], exc: BaseException) -> None:
        self.consecutive_failures += 1
        backoff = min(MAX_BACKOFF_S, 0.5 * 2 ** min(self.consecutive_failures, 10))
        backoff *= 0.5 + random.random() / 2  # jitter: processes do not come back in step
        if self.consecutive_failures == 1:
            message = "store %s: flush of %d object(s) failed, kept, next attempt in %.1f s: %s"
            logger.warning(message, self.name, len(batch), backoff, safe(exc, 200))
        for _, entry, _ in batch:
            entry.not_before = time.monotonic() + backoff

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

    def probe(self) -> StoreProbe:
        """This store's counters (the probe's ``write_behind``)."""
        return store_probe(self)
