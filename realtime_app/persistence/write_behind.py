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
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any, Generic, TypeVar

from django.db import DatabaseError, DataError, IntegrityError, InterfaceError, OperationalError, models, transaction
from django.db.models import Case, F, Q, Value, When
from django.utils import timezone

from realtime_app.observability.logsafe import safe
from realtime_app.persistence import journal
from realtime_app.persistence.journal import JournalFile

__all__ = ["Accepted", "WriteBehindStore", "flush_all", "install_shutdown_flush", "start_all", "stores", "stores_probe"]

logger = logging.getLogger("realtime_app.write_behind")

M = TypeVar("M", bound=models.Model)
Key = tuple[Any, ...]

UPSERT_BATCH = 50
DELETE_BATCH = 200
RETRIES = 3
MAX_BACKOFF_S = 30.0
#: PostgreSQL SQLSTATEs worth an immediate retry: deadlock, serialization failure.
TRANSIENT_PGCODES = {"40P01", "40001"}

_stores: list[WriteBehindStore[Any]] = []
_marks_swept = float("-inf")  # when old flush marks were last deleted


def stores() -> list[WriteBehindStore[Any]]:
    """Every store of this process (the probe lists them)."""
    return list(_stores)


@dataclass(slots=True)
class _Entry:
    state: dict[str, Any] | None  # None: deleted
    in_db: bool  # the row exists as far as this process knows
    version: int = 0  # bumped by each mutation
    flushed: int = 0  # the version the last successful flush wrote
    deltas: dict[str, int | float] = field(default_factory=dict)  # counters: change not yet written
    changed: dict[str, int] = field(default_factory=dict)  # plain field -> version of its last change
    dirty_since: float | None = None  # monotonic time of the oldest unsaved change
    not_before: float = 0.0  # pushed back after an error
    error: str | None = None  # a permanent failure, reported
    durable: dict[str, Any] | None = None  # the row as last read or written (None: no row)
    saved_at: float | None = None  # wall time of the last write that covered this object
    waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)
    generation: int = 0  # bumped by each delete: what an older snapshot took is moot
    replace: bool = False  # deleted since the last write: the next one writes the whole row
    in_doubt: bool = False  # in a batch whose outcome is not known yet


Batch = list[tuple[Key, _Entry, dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Accepted:
    """A mutation accepted in memory: its ``state`` now; ``await durable()`` for the flush."""

    state: dict[str, Any] | None
    version: int
    _store: WriteBehindStore[Any]
    _key: Key

    async def durable(self, timeout: float | None = None) -> None:
        """Wait until a flush has written this version (or a later one)."""
        await asyncio.wait_for(self._store._durable(self._key, self.version), timeout)


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
        self._entries: dict[Key, _Entry] = {}
        self._loading: dict[Key, asyncio.Future[_Entry]] = {}
        self._flush_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._inline = False  # write in the calling thread (the end of the process)
        self._in_doubt: list[tuple[str, Batch]] = []  # batches whose outcome is not known yet
        if max_objects < 1:
            raise ValueError("max_objects must be >= 1")
        self.max_objects = max_objects  # objects kept in memory; the least recently used clean ones go
        self._journals: list[JournalFile] = []  # journal files taken over, not yet all written
        self._journal_checked = False
        self.evicted = 0
        self.journaled = 0  # objects written to a journal at the end of this process
        self.replayed = 0  # objects taken over from journals
        # the probe
        self.flushed_rows = 0
        self.flushed_deletes = 0
        self.flushes = 0
        self.retries = 0
        self.consecutive_failures = 0
        self.last_flush: dict[str, Any] | None = None
        self.failing: dict[str, str] = {}  # key -> the permanent error that keeps it unsaved
        _stores.append(self)

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

    async def _entry(self, key: Key) -> _Entry:
        self._start()
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._entries[key] = entry  # the most recently used last: eviction starts at the front
            return entry
        loading = self._loading.get(key)
        if loading is None:  # one read per key, however many ask at once, in a task of its own:
            loading = asyncio.get_running_loop().create_task(self._load_into(key))  # a caller that is
            self._loading[key] = loading  # cancelled does not cancel the others' load
        return await asyncio.shield(loading)

    async def _load_into(self, key: Key) -> _Entry:
        try:
            entry = await self._load(key)
            entry = self._entries.setdefault(key, entry)
            self._evict(keep=key)  # never the one its caller is about to change
            return entry
        finally:
            self._loading.pop(key, None)

    def _evict(self, keep: Key | None = None) -> None:
        """Forget the least recently used objects that are saved, while over ``max_objects``
        (those with unsaved changes or waiters stay, however many there are, and ``keep``)."""
        over = len(self._entries) - self.max_objects
        if over <= 0:
            return
        gone: list[Key] = []
        for key, entry in self._entries.items():
            if len(gone) >= over:
                break
            if key == keep:
                continue
            if entry.dirty_since is None and not entry.in_doubt and not entry.waiters and entry.error is None:
                gone.append(key)
        for key in gone:
            del self._entries[key]
        self.evicted += len(gone)

    async def preload(self, keys: Iterable[Hashable]) -> int:
        """Load many objects at once (one query per 500), so that their first mutation
        reads nothing; returns how many were not loaded yet."""
        from channels.db import database_sync_to_async

        self._start()
        missing = [k for k in dict.fromkeys(self._key(key) for key in keys) if k not in self._entries]

        def read(chunk: list[Key]) -> dict[Key, dict[str, Any]]:
            where = Q()
            for key in chunk:
                where |= self._where(key)
            rows = self.model._default_manager.filter(where).values(*self.key_fields, *self.fields)
            return {tuple(row[f] for f in self.key_fields): {f: row[f] for f in self.fields} for row in rows}

        for i in range(0, len(missing), 500):
            chunk = missing[i : i + 500]
            found = await database_sync_to_async(read)(chunk)
            for key in chunk:
                if key in self._entries:
                    continue
                if key in found:
                    self._entries[key] = _Entry(state=found[key], in_db=True, durable=dict(found[key]))
                else:
                    self._entries[key] = _Entry(
                        state={**{f: None for f in self.fields}, **self.defaults(key)}, in_db=False
                    )
        self._evict()
        return len(missing)

    async def _load(self, key: Key) -> _Entry:
        from channels.db import database_sync_to_async

        def read() -> dict[str, Any] | None:
            rows = self.model._default_manager.filter(self._where(key)).values(*self.fields)
            return next(iter(rows), None)

        found = await database_sync_to_async(read)()
        if found is not None:
            return _Entry(state=found, in_db=True, durable=dict(found))
        return _Entry(state={**{f: None for f in self.fields}, **self.defaults(key)}, in_db=False)

    def durable(self, key: Hashable) -> tuple[dict[str, Any] | None, float | None]:
        """What the database holds for ``key`` as this process last read or wrote it, and
        when it last wrote it (wall time; None: not since it started). Loaded keys only."""
        entry = self._entries.get(self._key(key))
        if entry is None:
            return None, None
        return (None if entry.durable is None else dict(entry.durable)), entry.saved_at

    def unsaved(self, key: Hashable) -> bool:
        """True while ``key`` has a change that no flush has written yet."""
        entry = self._entries.get(self._key(key))
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

    def _dirty(self, entry: _Entry) -> None:
        if entry.dirty_since is None:
            entry.dirty_since = time.monotonic()
        if self._wake is not None:
            self._wake.set()

    async def _durable(self, key: Key, version: int) -> None:
        entry = self._entries.get(key)
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
            self._take_over_journals()
        self._task = loop.create_task(self._run(), name=f"write-behind {self.name}")
        install_shutdown_flush()

    def start(self) -> None:
        """Start the flush loop now (on the running loop), taking over the journals that
        ended processes left; otherwise it starts at the store's first use."""
        self._start()

    def _take_over_journals(self) -> None:
        """Journaled batches become in-doubt batches under their own tokens, written before
        anything newer (a batch that did commit is found by its token, not applied again)."""
        try:
            claimed = journal.claim(self.name)
        except OSError as exc:
            logger.error("store %s: the journal cannot be read: %s", self.name, exc)
            return
        now = time.monotonic()
        for file in claimed:
            for token, items in file.batches:
                batch: Batch = []
                for key, snap in items:
                    entry = self._entries.get(key)
                    if entry is None:
                        entry = self._entries[key] = _Entry(state=None, in_db=bool(snap["in_db"]))
                    entry.version += 1
                    snap = {**snap, "version": entry.version, "generation": entry.generation}
                    snap["changed"] = {name: entry.version for name in snap["changed"]}
                    entry.state = None if snap["state"] is None else dict(snap["state"])
                    for name, delta in snap["deltas"].items():
                        entry.deltas[name] = entry.deltas.get(name, 0) + delta
                    entry.changed.update(snap["changed"])
                    entry.replace = entry.replace or bool(snap["replace"])
                    entry.in_doubt = True
                    entry.dirty_since = now - self.delay_s  # due now
                    batch.append((key, entry, snap))
                    self.replayed += 1
                self._in_doubt.append((token, batch))
            self._journals.append(file)
            logger.warning(
                "store %s: %d object(s) taken over from %s, written before anything newer",
                self.name,
                sum(len(items) for _, items in file.batches),
                file.path,
            )

    def _settle_journals(self) -> None:
        """Delete the journal files taken over whose every batch is written."""
        pending = {token for token, _ in self._in_doubt}
        for file in list(self._journals):
            if not file.tokens & pending:
                file.remove()
                self._journals.remove(file)

    def journal_unsaved(self) -> int:
        """The process is ending: write what is still unsaved to a journal for the next
        process (the batches in doubt under their tokens, the rest under new ones); returns
        the objects kept. An ERROR says how many changes are lost if even that fails."""
        batches: list[tuple[str, list[tuple[Key, dict[str, Any]]]]] = []
        covered: dict[Key, dict[str, Any]] = {}  # the newest in-doubt snapshot of each key
        for token, batch in self._in_doubt:
            batches.append((token, [(key, snap) for key, _, snap in batch]))
            for key, _, snap in batch:
                covered[key] = snap
        rest = []
        for key, entry in self._entries.items():
            if entry.dirty_since is None:
                continue
            residual = _residual(self._snapshot(entry), covered.get(key))
            if residual is not None:
                rest.append((key, residual))
        for i in range(0, len(rest), UPSERT_BATCH):
            batches.append((uuid.uuid4().hex, rest[i : i + UPSERT_BATCH]))
        objects = sum(len(items) for _, items in batches)
        if not objects:
            self._remove_taken_over()
            return 0
        try:
            path = journal.write(self.name, batches)
        except OSError as exc:
            logger.error(
                "store %s: %d accepted object(s) LOST: the database and the journal both failed (%s)",
                self.name,
                objects,
                safe(exc, 200),
            )
            return 0
        self._remove_taken_over()  # what they held is in the new file
        self._in_doubt = []
        for entry in self._entries.values():  # handed over: never journaled (or written) twice
            if entry.dirty_since is not None or entry.in_doubt:
                entry.dirty_since, entry.in_doubt = None, False
                entry.deltas.clear()
                entry.changed.clear()
        self.journaled += objects
        logger.warning(
            "store %s: %d object(s) not written to the database, kept in %s for the next process",
            self.name,
            objects,
            path,
        )
        return objects

    def _remove_taken_over(self) -> None:
        for file in self._journals:
            file.remove()
        self._journals.clear()

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
        for entry in self._entries.values():
            if entry.dirty_since is None:
                continue
            when = max(entry.dirty_since + delay, entry.not_before)
            due = when if due is None else min(due, when)
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
                for key, entry in self._entries.items()
                if entry.dirty_since is not None
                and not entry.in_doubt
                and (everything or (entry.dirty_since + delay <= now and entry.not_before <= now))
            ]
            if not due and not written and not failed:
                self._settle_journals()
                return 0
            snapshots = [(key, entry, self._snapshot(entry)) for key, entry in due]
            more, more_failed = await self._write(snapshots)
            written, failed = written + more, failed + more_failed
            self._settle_journals()
            duration = time.monotonic() - started
            self.flushes += 1
            self.last_flush = {
                "at": time.time(),
                "rows": written,
                "duration_ms": round(duration * 1000, 1),
                "failed": failed,
            }
            return written

    def _snapshot(self, entry: _Entry) -> dict[str, Any]:
        return {
            "version": entry.version,
            "state": None if entry.state is None else dict(entry.state),
            "deltas": dict(entry.deltas),
            "changed": dict(entry.changed),
            "in_db": entry.in_db,
            "generation": entry.generation,
            "replace": entry.replace,
        }

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
            current = await self._with_retries(partial(self._batch_writer(), batch, token))
        except _Permanent as exc:  # rolled back: split until the objects at fault stand alone
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
        self._written(batch, current)
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

    async def _with_retries(self, attempt: Callable[[], Any]) -> Any:
        for n in range(RETRIES + 1):
            try:
                return await attempt()
            except (IntegrityError, DataError) as exc:
                raise _Permanent(exc) from exc
            except (OperationalError, InterfaceError, DatabaseError) as exc:
                if not _transient(exc) or n == RETRIES:
                    raise
                self.retries += 1
                await asyncio.sleep(0.05 * (2**n))

    def _cannot_save(self, item: tuple[Key, _Entry, dict[str, Any]], exc: _Permanent) -> None:
        """The database refuses this object for good: keep it, report it, try it rarely."""
        key, entry, _ = item
        message = f"{type(exc.cause).__name__}: {safe(exc.cause, 200)}"
        if self.failing.get(repr(key)) != message:
            logger.error("store %s: %r cannot be saved, kept in memory: %s", self.name, key, message)
        self.failing[repr(key)] = message
        entry.error = message
        entry.not_before = time.monotonic() + MAX_BACKOFF_S

    def _batch_writer(self) -> Callable[[Batch, str], Any]:
        """How a batch reaches the database: in Django's worker thread — or right here
        when the process is ending and no thread may be started any more."""
        if self._inline:

            async def inline(batch: Batch, token: str) -> Any:
                return self._write_batch(batch, token)

            return inline
        from channels.db import database_sync_to_async

        writer: Callable[[Batch, str], Any] = database_sync_to_async(self._write_batch)
        return writer

    def _failed_transiently(self, batch: list[tuple[Key, _Entry, dict[str, Any]]], exc: BaseException) -> None:
        self.consecutive_failures += 1
        backoff = min(MAX_BACKOFF_S, 0.5 * 2 ** min(self.consecutive_failures, 10))
        backoff *= 0.5 + random.random() / 2  # jitter: processes do not come back in step
        if self.consecutive_failures == 1:
            logger.warning(
                "store %s: flush of %d object(s) failed, kept, next attempt in %.1f s: %s",
                self.name,
                len(batch),
                backoff,
                safe(exc, 200),
            )
        for _, entry, _ in batch:
            entry.not_before = time.monotonic() + backoff

    def _written(self, batch: list[tuple[Key, _Entry, dict[str, Any]]], current: dict[Key, dict[str, Any]]) -> None:
        """A batch is durable: settle what it wrote, keep what changed meanwhile, and take
        the counters as the database holds them (other processes' deltas included)."""
        if self.consecutive_failures:
            logger.info("store %s: flushing again after %d failure(s)", self.name, self.consecutive_failures)
            self.consecutive_failures = 0
        for key, entry, snap in batch:
            version = snap["version"]
            entry.in_doubt = False
            if entry.generation == snap["generation"]:  # else deleted since: its deltas are gone
                for name, delta in snap["deltas"].items():
                    left = entry.deltas.get(name, 0) - delta
                    if left:
                        entry.deltas[name] = left
                    else:
                        entry.deltas.pop(name, None)
                for name, changed_at in snap["changed"].items():
                    if entry.changed.get(name) == changed_at:
                        del entry.changed[name]
                if snap["replace"]:
                    entry.replace = False
            if snap["state"] is None:
                entry.in_db = False
                entry.durable = None
                self.flushed_deletes += 1
            else:
                entry.in_db = True
                durable = dict(entry.durable or snap["state"])
                durable.update({name: snap["state"][name] for name in snap["changed"]})
                self.flushed_rows += 1
            entry.saved_at = time.time()
            row = current.get(key)
            if snap["state"] is not None:
                if row is not None:
                    durable.update({name: row[name] for name in self.counters})
                entry.durable = durable
            if row is not None and entry.state is not None and entry.generation == snap["generation"]:
                for name in self.counters:  # the database's value plus what is not yet written
                    entry.state[name] = row[name] + entry.deltas.get(name, 0)
            entry.flushed = max(entry.flushed, version)
            entry.error = None
            self.failing.pop(repr(key), None)
            entry.not_before = 0.0
            if entry.version == entry.flushed:
                entry.dirty_since = None
            else:
                entry.dirty_since = time.monotonic()  # changed during the flush: due again later
            still = []
            for wanted, future in entry.waiters:
                if wanted <= entry.flushed:
                    if not future.done() and not future.get_loop().is_closed():
                        future.set_result(None)
                else:
                    still.append((wanted, future))
            entry.waiters = still

    def _where(self, key: Key) -> Q:
        return Q(**dict(zip(self.key_fields, key, strict=True)))

    def _write_batch(self, batch: Batch, token: str) -> dict[Key, dict[str, Any]]:
        """One batch in one transaction (runs in a worker thread); returns the counters as
        the database holds them now, other processes' deltas included.

        Its first statement writes the batch's token: if that token is there already, the
        batch was committed before (its answer was lost) and nothing is written again.
        """
        manager = self.model._default_manager
        with transaction.atomic():
            if not self._mark(token):
                return self._read_counters([key for key, _, snap in batch if snap["state"] is not None])
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
            return self._read_counters([key for key, _ in deltas] + [key for key, _ in replaced])

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

    def _read_counters(self, keys: list[Key]) -> dict[Key, dict[str, Any]]:
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

    # -- shutdown and probe -------------------------------------------------------------

    def close(self) -> None:
        """Forget this store: its loop stops and it is no longer flushed at shutdown or
        listed in the probe. What is unsaved is dropped — flush first to keep it."""
        if self._task is not None and not self._task.done() and self._loop is not None and not self._loop.is_closed():
            self._task.cancel()
        with contextlib.suppress(ValueError):
            _stores.remove(self)

    async def aflush_all(self) -> int:
        """Write everything dirty now (shutdown), retrying transient errors."""
        return await self.flush(everything=True)

    def probe(self) -> dict[str, Any]:
        now = time.monotonic()
        dirty = [e for e in self._entries.values() if e.dirty_since is not None]
        oldest = max((now - e.dirty_since for e in dirty if e.dirty_since is not None), default=0.0)
        return {
            "objects": len(self._entries),
            "dirty": len(dirty),
            "oldest_unsaved_s": round(oldest, 3),
            "last_flush": self.last_flush,
            "consecutive_failures": self.consecutive_failures,
            "retries": self.retries,
            "flushes": self.flushes,
            "flushed_rows": self.flushed_rows,
            "flushed_deletes": self.flushed_deletes,
            "failing": dict(list(self.failing.items())[:10]),
            "in_doubt": sum(len(batch) for _, batch in self._in_doubt),
            "delay_s": self.delay_s,
            "evicted": self.evicted,
            "journaled": self.journaled,
            "replayed": self.replayed,
        }


class _Permanent(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(cause)
        self.cause = cause


def _transient(exc: BaseException) -> bool:
    """A lost connection, a deadlock, a serialization failure: worth trying again."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    cause = exc.__cause__
    code = getattr(cause, "pgcode", None) or getattr(getattr(cause, "diag", None), "sqlstate", None)
    return code in TRANSIENT_PGCODES


def stores_probe() -> dict[str, dict[str, Any]]:
    """Every store's counters (the probe's ``write_behind``)."""
    return {store.name: store.probe() for store in stores()}


_shutdown_installed = False
_atexit_installed = False


def _flush_at_exit() -> None:
    """A process ending without a server's shutdown (a management command, a script):
    write what is still dirty, on a loop of its own."""
    if not any(e.dirty_since is not None for store in stores() for e in store._entries.values()):
        return
    import os

    for store in stores():
        store._flush_lock = asyncio.Lock()
        store._inline = True  # threads can no longer be started at exit
    # The database is called from the (only) thread left, inside the loop that drives the
    # flush: nothing else runs at this point, so Django's async-safety guard is lifted.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        written = asyncio.run(flush_all())
        logger.info("exit: %d object(s) flushed", written)
    except Exception:
        logger.exception("exit: the final flush failed")


def install_shutdown_flush() -> None:
    """Flush every store when the server shuts down. Daphne has no ASGI lifespan: hook
    Twisted's shutdown (SIGTERM and SIGINT stop the reactor; the flush runs before). Under
    uvicorn, route ``lifespan`` to :func:`realtime_app.lifespan.lifespan_app` instead."""
    global _shutdown_installed, _atexit_installed
    import atexit
    import sys

    if not _atexit_installed:
        _atexit_installed = True
        atexit.register(_flush_at_exit)

    if _shutdown_installed or "twisted.internet.reactor" not in sys.modules:
        return
    from twisted.internet import defer, reactor

    if not getattr(reactor, "running", False):
        return
    _shutdown_installed = True

    def before_shutdown() -> Any:
        return defer.Deferred.fromFuture(asyncio.ensure_future(flush_all()))

    reactor_: Any = reactor
    reactor_.addSystemEventTrigger("before", "shutdown", before_shutdown)


async def flush_all() -> int:
    """Flush every store of this process (shutdown, the end of a command); what cannot be
    written goes to the journal for the next process (:mod:`realtime_app.persistence.journal`)."""
    written = 0
    for store in stores():
        try:
            written += await store.aflush_all()
        except Exception:
            logger.exception("store %s: final flush failed", store.name)
        store.journal_unsaved()
    return written


def start_all() -> None:
    """Start every store's flush loop on the running loop, taking over journals (a
    server's start: the hub's, the ASGI lifespan's)."""
    for store in stores():
        store.start()


def _residual(now: dict[str, Any], doubt: dict[str, Any] | None) -> dict[str, Any] | None:
    """What an object's snapshot ``now`` holds beyond the in-doubt batch snapshot ``doubt``
    of the same object (journaled apart, under its own token); None when nothing."""
    if doubt is None or now["generation"] != doubt["generation"]:
        return now  # deleted since: the whole row (or its delete) replaces it
    deltas = {}
    for name in set(now["deltas"]) | set(doubt["deltas"]):
        left = now["deltas"].get(name, 0) - doubt["deltas"].get(name, 0)
        if left:
            deltas[name] = left
    changed = {name: v for name, v in now["changed"].items() if doubt["changed"].get(name) != v}
    if not deltas and not changed:
        return None
    return {**now, "deltas": deltas, "changed": changed, "replace": False, "in_db": True}
