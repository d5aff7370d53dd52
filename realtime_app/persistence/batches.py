"""How a write-behind store writes its batches: each under its token, retried while the
outage is transient, split until the objects the database refuses stand alone (those are
refused, never retried forever nor journaled), and the counters read back on a beat."""

from __future__ import annotations

import hashlib
import logging
import random
import time
import uuid
from functools import partial
from typing import Any

from django.db import DatabaseError, InterfaceError

from realtime_app.observability.logsafe import safe
from realtime_app.persistence.entries import Batch, Entry, Key, WriteRefused, adopt, refresh, settle, unsettle
from realtime_app.persistence.handover import Handover
from realtime_app.persistence.sql import Permanent, Table, with_retries

__all__ = ["BatchWriter", "absent", "derived"]

logger = logging.getLogger("realtime_app.write_behind")

UPSERT_BATCH = 50
DELETE_BATCH = 200
RETRIES = 3
MAX_BACKOFF_S = 30.0


class BatchWriter:
    """The batch-writing half of :class:`~realtime_app.persistence.write_behind.WriteBehindStore`."""

    name: str
    entries: dict[Key, Entry]
    counters: frozenset[str]
    table: Table[Any]
    handover: Handover
    failing: dict[str, str]
    _in_doubt: list[tuple[str, Batch]]
    _inline: bool
    _refreshed_at: float
    refused: int
    retries: int
    consecutive_failures: int
    flushed_rows: int
    flushed_deletes: int

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

    async def _write_one(
        self, batch: Batch, token: str, *, again: bool = False, journaled: bool = False
    ) -> tuple[int, int]:
        """Write one batch under its token, retrying; split it if it fails for good.

        The token is written in the batch's transaction: a retry of the same batch finds
        it and settles instead of applying the counter deltas twice (the COMMIT may have
        succeeded when its answer was lost). A batch whose outcome stays unknown is kept
        *in doubt*, whole, and written again under the same token before anything newer
        (``again``: it is counted in its objects' ``in_doubt`` already). The halves of a
        split batch get tokens derived from its own — a journaled batch's halves are found
        again if the journal is put back — and ``journaled`` marks them kept for good.
        """
        if not again:
            for _, entry, _ in batch:
                entry.in_doubt += 1
        journaled = journaled or token in self.handover.tokens
        try:
            write = partial(self.table.run, self.table.write_batch, batch, token, journaled, inline=self._inline)
            current = await with_retries(write, RETRIES, self._retried)
        except Permanent as exc:  # rolled back: split until the objects at fault stand alone
            for _, entry, _ in batch:
                entry.in_doubt = max(0, entry.in_doubt - 1)
            if len(batch) == 1:
                self._refuse(batch[0], exc)
                return 0, 1
            half = len(batch) // 2
            done_a, bad_a = await self._write_one(batch[:half], derived(token, "a"), journaled=journaled)
            done_b, bad_b = await self._write_one(batch[half:], derived(token, "b"), journaled=journaled)
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
            done, bad = await self._write_one(batch, token, again=True)
            written += done
            failed += bad
        return written, failed

    def _retried(self) -> None:
        self.retries += 1

    def _refuse(self, item: tuple[Key, Entry, dict[str, Any]], exc: Permanent) -> None:
        """The database refuses this object for a reason an outage does not explain: its
        unsaved changes are dropped (never retried forever, never journaled), whoever waits
        for them is told, and it is read again from the database at its next use."""
        key, entry, snap = item
        message = f"{type(exc.cause).__name__}: {safe(exc.cause, 200)}"
        logger.error("store %s: %r refused by the database, its unsaved changes dropped: %s", self.name, key, message)
        self.refused += 1
        self.failing.pop(repr(key), None)
        self.failing[repr(key)] = message
        while len(self.failing) > 10:
            self.failing.pop(next(iter(self.failing)))
        entry.error = message
        entry.refused = (entry.flushed, snap["version"] if entry.in_doubt else entry.version, message)
        if entry.in_doubt:  # another batch of it is still to be settled: only what this one held goes
            unsettle(entry, snap)
        else:  # nothing of it left to write: forgotten like a saved object when memory is short
            entry.deltas.clear()
            entry.changed.clear()
            entry.dirty_since, entry.replace, entry.stale, entry.error = None, False, True, None
        for _, future in entry.waiters:
            if not future.done() and not future.get_loop().is_closed():
                future.set_exception(WriteRefused(self.name, key, message))
        entry.waiters = []

    async def _refresh_counters(self) -> None:
        """Every delay (a second at least) the counters held are read back, in pages of 500:
        a process that writes nothing still sees the others' deltas within the delay plus
        one flush. An object held before its row existed is read whole: once another
        process made the row, this one holds it too. An entry evicted and loaded again
        meanwhile is left as loaded."""
        self._refreshed_at = time.monotonic()
        held = [(key, entry) for key, entry in self.entries.items() if entry.in_db and not entry.in_doubt]
        missing = [(key, entry) for key, entry in self.entries.items() if absent(entry)]
        for read, entries in ((self.table.read_counters, held), (self.table.read, missing)):
            for page in (dict(entries[i : i + 500]) for i in range(0, len(entries), 500)):
                try:  # an outage is reported by the writes; this waits for its next turn
                    rows = await self.table.run(read, list(page))
                except (DatabaseError, InterfaceError) as exc:
                    return logger.debug("store %s: counters not read back: %s", self.name, safe(exc, 200))
                for key, row in rows.items():
                    if self.entries.get(key) is not page.get(key):
                        continue
                    if page[key].in_db:
                        refresh(page[key], row, self.counters)
                    elif absent(page[key]):  # still nothing of its own (no change nor delete during the read)
                        adopt(page[key], row)

    def _failed_transiently(self, batch: list[tuple[Key, Entry, dict[str, Any]]], exc: BaseException) -> None:
        self.consecutive_failures += 1
        backoff = min(MAX_BACKOFF_S, 0.5 * 2 ** min(self.consecutive_failures, 10))
        backoff *= 0.5 + random.random() / 2  # jitter: processes do not come back in step
        if self.consecutive_failures == 1:
            message = "store %s: flush of %d object(s) failed, kept, next attempt in %.1f s: %s"
            logger.warning(message, self.name, len(batch), backoff, safe(exc, 200))
        for _, entry, _ in batch:
            entry.not_before = time.monotonic() + backoff


def derived(token: str, half: str) -> str:
    """The token of one half of a split batch: the same whenever that batch is split."""
    return hashlib.sha256(f"{token}:{half}".encode()).hexdigest()[:32]


def absent(entry: Entry) -> bool:
    """Held with no row in the database and nothing of its own to write: another process
    may make the row."""
    return not entry.in_db and entry.state is not None and entry.dirty_since is None and not entry.in_doubt
