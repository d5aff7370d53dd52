"""The drain of the outbox (durable channels, docs/transactions.md): every process looks
for committed rows each beat — and at once after a commit of its own — and publishes them
in id order per channel, each with its row's key so that the backplane publishes it once,
then deletes them.

One process drains a channel at a time: a lease per channel on the backplane, the
tickers' own (:meth:`~realtime_app.cluster.base.Backplane.acquire`). While the backplane
is down the rows wait, in order; after a process was killed between a publication and
its delete, the next drain finds the rows and the backplane says they went out already.
The counters (rows waiting, the oldest's age, an alarm) are the probe's ``outbox``.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from realtime_app.cancellation import uninterrupted
from realtime_app.conf import beat_period_s
from realtime_app.conf.runtime import runtime, settings
from realtime_app.declarations.registry import registry
from realtime_app.exceptions import UnknownChannel
from realtime_app.persistence import outbox
from realtime_app.persistence.connection_thread import ConnectionThread
from realtime_app.wire.history import HistoryPolicy

if TYPE_CHECKING:
    from realtime_app.cluster.roles import DurableBroker
    from realtime_app.observability.schema import OutboxProbe


class Hub(Protocol):
    """What the drain reads of its hub (``hub.core.Hub``, which imports this room)."""

    loop: asyncio.AbstractEventLoop | None

    @property
    def backplane(self) -> DurableBroker | None: ...

    last_seq: dict[str, int]


__all__ = [
    "NEAR_FULL",
    "OutboxDrain",
    "drain_outbox",
    "outbox_full",
    "outbox_probe",
    "outbox_refusal",
    "outbox_written",
]

#: Past this share of ``OUTBOX_MAX_ROWS`` (as counted at the last beat, plus what this
#: process wrote since), each durable publication counts the rows waiting in its own
#: transaction first: the bound holds exactly, not as of the last beat.
NEAR_FULL = 0.9

logger = logging.getLogger("realtime_app.outbox")

#: Channels looked at per pass, rows read at once per channel, reads per channel per pass
#: (a busy channel gives the others their turn).
CHANNELS_PER_PASS = 100
ROWS_PER_READ = 200
READS_PER_PASS = 5
LEASE_PREFIX = "realtime.outbox:"


class OutboxDrain:
    """One hub's drain: its counters, and its wake-up."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self.woken = asyncio.Event()
        self.rows = 0  # waiting, as last counted
        self.written = 0  # rows this process wrote since (an estimate: some may have rolled back)
        self.refused = 0  # durable publications refused while full
        self.full_said = False  # its refusals were logged (once while they last)
        self.oldest: datetime.datetime | None = None
        self.published = 0
        self.duplicates = 0  # rows the backplane had published already (a repeated drain)
        self.failures = 0  # passes stopped by an error
        self._failing = False
        self._counted = 0.0  # when rows were last counted (at most once a beat)
        self._unknown: set[str] = set()  # channels with rows this process cannot publish (logged once)
        # its queries, each beat, on connections kept open between them (not one opened a beat)
        self.database = ConnectionThread("realtime-outbox")

    def wake(self) -> None:
        """From any thread: a commit wrote rows."""
        loop = self.hub.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.woken.set)

    async def run(self) -> None:
        stop = outbox.on_written(self.wake)
        try:
            while True:
                try:
                    await asyncio.wait_for(self.woken.wait(), beat_period_s(settings().lease_ttl_ms))
                except TimeoutError:
                    pass
                self.woken.clear()
                await self.drain()
        finally:
            stop()
            await uninterrupted(self.aclose())

    async def aclose(self) -> None:
        """Let go of the drain's database thread and its connections (a drain made and
        never run, as in tests, is closed by whoever made it)."""
        await self.database.aclose()

    async def drain(self) -> int:
        """One pass over every outbox database: rows published. Nothing is read while no
        durable channel is declared (a project without one pays nothing)."""
        if not _any_durable():
            return 0
        published = 0
        counting = time.monotonic() - self._counted >= beat_period_s(settings().lease_ttl_ms)
        empty: set[str] = set()  # databases with nothing waiting: counted without asking again
        for alias in settings().outbox_databases:
            try:
                waiting = await self.database.call(alias, outbox.channels_waiting, CHANNELS_PER_PASS)
                if not waiting:
                    empty.add(alias)
                for channel in waiting:
                    published += await self._drain_channel(alias, channel)
            except Exception as exc:  # the database or the backplane: the rows wait, in order
                self.failures += 1
                if not self._failing:
                    logger.warning("outbox of %r not drained: %s (the rows wait; retried each beat)", alias, exc)
                self._failing = True
                if counting:  # what waits is counted all the same: OUTBOX_MAX_ROWS holds during an outage
                    await self._count(empty)
                return published
        if counting:
            await self._count(empty)
        if self._failing:
            logger.info("outbox drained again")
        self._failing = False
        return published

    async def _count(self, empty: set[str]) -> None:
        """Rows waiting in every outbox database and the oldest of them all (a database
        that does not answer is left out; none answering keeps the last count)."""
        counts: list[tuple[int, datetime.datetime | None]] = []
        for alias in settings().outbox_databases:
            try:
                counts.append((0, None) if alias in empty else await self.database.call(alias, outbox.stats))
            except Exception:  # said by the drain's warning
                logger.debug("outbox of %r not counted", alias)
        if counts:
            self.rows, self.written = sum(rows for rows, _ in counts), 0
            self.oldest = min((oldest for _, oldest in counts if oldest is not None), default=None)
        self._counted = time.monotonic()

    async def _drain_channel(self, alias: str, channel: str) -> int:
        backplane = self.hub.backplane
        if backplane is None:
            return 0
        history = self._history(channel)
        if history is None:  # not durable here (a process of an older deploy): left for one that knows it
            if channel not in self._unknown and len(self._unknown) < 10_000:
                self._unknown.add(channel)
                logger.warning("outbox: rows of %r waiting, not a durable channel in this process", channel)
            return 0
        lease = LEASE_PREFIX + channel
        if not await backplane.acquire(lease):
            return 0  # another process drains it now
        window_ms = int(settings().outbox_dedupe_window_s) * 1000
        published = 0
        try:
            for _ in range(READS_PER_PASS):
                rows = await self.database.call(alias, outbox.read, channel, ROWS_PER_READ)
                if not rows:
                    break
                floor = self.hub.last_seq.get(channel, 0)
                for row in rows:
                    seq = await backplane.publish_once(
                        channel, row.data, floor, history, f"{alias}:{row.id}", window_ms
                    )
                    if seq is None:
                        self.duplicates += 1
                    else:
                        published, self.published, floor = published + 1, self.published + 1, max(floor, seq)
                await self.database.call(alias, outbox.delete, [row.id for row in rows])
                if not await backplane.renew(lease):  # another process took the channel over
                    break
        except backplane.errors as exc:
            backplane.outage.failed(exc)
            raise
        finally:
            await _release(backplane, lease)
        return published

    @staticmethod
    def _history(channel: str) -> HistoryPolicy | None:
        try:
            spec = registry.resolve(channel)
        except UnknownChannel:
            return None
        return spec.history if spec.history is not None and spec.history.durable else None

    def probe(self) -> OutboxProbe:
        config = settings()
        now = datetime.datetime.now(datetime.UTC)
        oldest = (now - self.oldest).total_seconds() if self.oldest is not None else 0.0
        alarm = ""
        if self.rows >= int(config.outbox_max_rows):
            alarm = f"{self.rows} rows waiting (OUTBOX_MAX_ROWS {config.outbox_max_rows})"
        elif oldest > float(config.outbox_max_age_s):
            alarm = f"the oldest row waits for {oldest:.0f} s (OUTBOX_MAX_AGE_S {config.outbox_max_age_s})"
        return {
            "rows": self.rows,
            "oldest_s": round(max(oldest, 0.0), 3),
            "published": self.published,
            "duplicates": self.duplicates,
            "failures": self.failures,
            "refused": self.refused,
            "alarm": alarm,
        }


def _any_durable() -> bool:
    histories = [spec.history for spec in registry.exact.values()]
    histories += [declared.history for declared in registry.templates.values()]
    return any(history is not None and history.durable for history in histories)


async def _release(backplane: DurableBroker, lease: str) -> None:
    try:
        await backplane.release(lease)
    except Exception:  # lapses with its TTL
        logger.debug("outbox lease %s not released", lease)


class OutboxDrains(weakref.WeakKeyDictionary[Any, OutboxDrain]):
    """Each hub's outbox drain (a part of the process's runtime)."""


def _drains() -> OutboxDrains:
    return runtime().part(OutboxDrains)


async def drain_outbox(hub: Hub) -> None:
    """The hub's outbox loop (listed in :mod:`realtime_app.endpoint.wiring`)."""
    drain = _drains()[hub] = OutboxDrain(hub)
    await drain.run()


def outbox_probe(hub: object) -> OutboxProbe:
    drain = _drains().get(hub)
    if drain is None:
        return {"rows": 0, "oldest_s": 0.0, "published": 0, "duplicates": 0, "failures": 0, "refused": 0, "alarm": ""}
    return drain.probe()


def outbox_full() -> bool:
    """True while the outbox holds ``OUTBOX_MAX_ROWS`` rows or more (as this process's
    drains last counted)."""
    limit = int(settings().outbox_max_rows)
    return bool(limit) and any(drain.rows >= limit for drain in list(_drains().values()))


def outbox_written() -> None:
    """A durable publication wrote its row (in the caller's transaction)."""
    for drain in list(_drains().values()):
        drain.written += 1


def _said_free(drains: list[OutboxDrain], waiting: int | None) -> None:
    """The outbox takes publications again: said once, after it was said full."""
    if any(d.full_said for d in drains):
        logger.info(
            "the outbox takes durable publications again (%s rows waiting)", waiting if waiting is not None else "fewer"
        )
    for drain in drains:
        drain.full_said = False


def outbox_refusal(using: str | None = None) -> tuple[int, int] | None:
    """``(limit, retry_after_ms)`` when a durable publication would pass
    ``OUTBOX_MAX_ROWS`` (counted exactly, in the caller's thread and transaction, once
    the estimate is within :data:`NEAR_FULL` of it); None when it fits. Two transactions
    counting at the same instant may each take the last place."""
    config = settings()
    limit = int(config.outbox_max_rows)
    drains = list(_drains().values())
    if not limit or not drains or max(d.rows + d.written for d in drains) < limit * NEAR_FULL:
        _said_free(drains, None)
        return None
    waiting = 0
    for alias in config.outbox_databases:
        if alias == using:  # the caller's own: counted in its transaction, an error is its error
            waiting += outbox.rows_up_to(alias, limit)
        else:
            try:
                waiting += outbox.rows_up_to(alias, limit)
            except Exception:  # another database that does not answer: not counted
                logger.debug("outbox of %r not counted", alias)
        if waiting >= limit:
            break
    if waiting < limit:
        _said_free(drains, waiting)
        return None
    if not any(d.full_said for d in drains):  # once while it lasts, not once per publication
        logger.warning(
            "the outbox is full (%d rows, OUTBOX_MAX_ROWS): durable publications are refused "
            "(-32003 outbox_full) until it drains",
            waiting,
        )
    for drain in drains:
        drain.refused += 1
        drain.full_said = True
    return limit, int(beat_period_s(config.lease_ttl_ms) * 1000)
