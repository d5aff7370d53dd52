"""The cluster backplane on PostgreSQL alone: ``LISTEN``/``NOTIFY`` and the tables of
:mod:`realtime_app.cluster.postgres_sql`, so that a Django site on PostgreSQL runs several
processes without Redis (``BACKPLANE = "postgres"``, docs/postgres-backplane.md).

Each process holds one listening connection, on which it ``LISTEN``\\ s to the channel of
every channel it has local subscribers for (``rt_`` and a hash of ``KEY_PREFIX`` and the
group name: PostgreSQL's names are 63 bytes at most), and a bounded pool for everything
else. A publication is numbered, kept (a channel with history) and notified by **one**
function call — one round trip for the publisher and one ``NOTIFY`` whatever the number of
processes; notifications of one channel reach each process in commit order, which is
``seq`` order (the channel's row is locked from numbering to commit). A publication too
large for a ``NOTIFY`` travels through a table, read back by each receiving process.

Nothing is assumed to stay: the listening connection, when it comes back after a cut or a
restart, listens again to every channel this process wants (level-triggered); :meth:`check`
reports it — and a sentinel row that lapsed (every ``REASSERT_INTERVAL_MS``) or a server
that restarted — so that the hub joins, reseeds and re-asserts its leases. Rows carry their
own end and are pruned a bounded batch at a time by every process's beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from typing import Any

import psycopg
from psycopg import sql

from realtime_app.cancellation import cancel_and_wait, uninterrupted
from realtime_app.cluster.base import Backplane, Deliver, delivery, now_ms
from realtime_app.cluster.postgres_pool import MIGRATE_HINT, Pool, TablesMissing, connection_params, discard, label
from realtime_app.cluster.postgres_sql import PRUNE, PRUNE_BATCH
from realtime_app.cluster.postgres_stores import PostgresStores
from realtime_app.observability.schema import ProcessProbe, ShardProbe
from realtime_app.wire.history import HistoryPolicy
from realtime_app.wire.names import group_name
from realtime_app.wire.protocol import notification_head

__all__ = ["TABLES_THERE", "PostgresBackplane", "TablesMissing", "pg_channel"]

logger = logging.getLogger("realtime_app.backplane")

#: How long one wait of the idle listening connection lasts (a command wakes it earlier).
IDLE_READ_S = 5.0
#: How often each process prunes rows past their end, seconds.
PRUNE_EVERY_S = 10.0
#: Whether the tables and functions are there (``migrate`` ran, and was not rolled back).
TABLES_THERE = (
    "SELECT to_regclass('realtime_app_bp_key') IS NOT NULL AND to_regclass('realtime_app_bp_channel') IS NOT NULL "
    "AND to_regproc('realtime_app_bp_publish_kept') IS NOT NULL"
)
#: How long one prune goes on while its batches are full, seconds.
PRUNE_BUDGET_S = 2.0


def pg_channel(prefix: str, name: str) -> str:
    """The ``LISTEN`` channel of ``name`` (a group, or a process's own) under ``prefix``."""
    return "rt_" + hashlib.sha1(f"{prefix}:{name}".encode(), usedforsecurity=False).hexdigest()[:40]


class PostgresBackplane(PostgresStores, Backplane):
    """A cluster of processes sharing one PostgreSQL database: its tables, and its
    notifications."""

    clustered = True
    errors: tuple[type[BaseException], ...] = (psycopg.Error, OSError, TimeoutError)

    def __init__(
        self,
        *,
        instance_id: str = "headless",
        config: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(instance_id=instance_id, config=config)
        settings = self._cluster_settings(config)
        params = params if params is not None else connection_params(settings)
        self.address = label(params)
        self.pool = Pool(params, settings["POSTGRES_POOL_SIZE"], settings["POSTGRES_TIMEOUT_MS"] / 1000)
        self.own_channel = pg_channel(self.prefix, f"proc:{self.instance_id}")
        self._names: dict[str, str] = {}  # LISTEN channel -> channel, for what this process joined
        self._listening: set[str] = set()  # what the listening connection listens to now
        self._listener: psycopg.AsyncConnection[Any] | None = None
        self._commands: list[tuple[str, list[str], asyncio.Future[None]]] = []
        self._receiver: asyncio.Task[None] | None = None
        self._receive_errors: set[type[BaseException]] = set()  # logged once per kind
        self._relistened = False  # the listening connection came back since the last check
        self._run_id: str | None = None
        self._pruned = 0.0
        self._pruner: asyncio.Task[None] | None = None  # the prune under way, if any
        self._deliver_to: Deliver | None = None
        self._heard = time.monotonic()  # when the listening connection last heard anything
        #: Silent this long despite an echo each beat, the listening connection is dead.
        self.silent_s = max(3.0, 3 * self.lease_ttl_ms / 1000)
        self._probes: dict[str, tuple[str, ProcessProbe]] = {}  # the others' probes as last read

    def key(self, kind: str, channel: str) -> str:
        """A channel's row (count, epoch, history, presence) under ``KEY_PREFIX``."""
        return f"{self.prefix}:{kind}:{group_name(channel)}"

    def scope(self, kind: str) -> str:
        """The scope of a kind of keyed value (leases, probes, ...) under ``KEY_PREFIX``."""
        return f"{self.prefix}:{kind}"

    def notify_channel(self, channel: str) -> str:
        return pg_channel(self.prefix, group_name(channel))

    def shards_probe(self) -> list[ShardProbe]:
        return [{"index": 0, "address": self.address, "up": not self.outage.down, "outages": self.outage.outages}]

    # -- lifecycle ----------------------------------------------------------------

    async def start(self, deliver: Deliver) -> None:
        """Open the listening connection (listening to this process's own channel first)
        and make sure the tables are there."""
        if (await self.pool.one(TABLES_THERE))[0] is not True:
            raise TablesMissing(f"the database {self.address} has no realtime_app backplane tables: {MIGRATE_HINT}")
        self._listener = await self._listen_again()
        self._relistened = False
        self._deliver_to = deliver
        self._heard = time.monotonic()
        self._receiver = asyncio.get_running_loop().create_task(self._receive(deliver), name="realtime-receive")

    async def stop(self) -> None:
        """Stopped to the end once begun, whatever the caller hears meanwhile."""
        await uninterrupted(self._stop())

    async def _stop(self) -> None:
        self.outage.stop()
        receiver, self._receiver = self._receiver, None
        pruner, self._pruner = self._pruner, None
        await cancel_and_wait(receiver, pruner)
        listener, self._listener = self._listener, None
        if listener is not None:
            await discard(listener)
        for _, _, future in self._commands:
            future.cancel()
        await self.pool.close()

    async def _listen_again(self) -> psycopg.AsyncConnection[Any]:
        """A listening connection, listening to this process's own channel and to every
        channel it joined (all of them: what a lost connection listened to is gone)."""
        conn = await self.pool.connect()
        try:
            names = [self.own_channel, *self._names]
            async with asyncio.timeout(self.pool.timeout_s):
                await self._listen(conn, "LISTEN", names)
        except BaseException:
            await discard(conn)
            raise
        self._listening = set(names)
        listener: psycopg.AsyncConnection[Any] = conn
        return listener

    async def _listen(self, conn: psycopg.AsyncConnection[Any], verb: str, names: list[str]) -> None:
        for start in range(0, len(names), 500):
            batch = names[start : start + 500]
            await conn.execute(sql.SQL(" ").join(sql.SQL(verb + " {};").format(sql.Identifier(n)) for n in batch))

    async def _receive(self, deliver: Deliver) -> None:
        while True:
            try:
                conn = self._listener
                if conn is None or conn.closed:
                    self._listener = None
                    if conn is not None:
                        await discard(conn)
                    conn = self._listener = await self._listen_again()
                    self._relistened = True
                await self._run_commands(conn)
                # A batch at a time (stop_after: the generator ends after the packet it read,
                # never in the middle of one): a command waiting is run between batches.
                # (Found: breaking out for a command dropped the rest of the packet — 561 of
                # 3,000 publications lost while the process joined 200 channels.)
                async with contextlib.aclosing(conn.notifies(timeout=IDLE_READ_S, stop_after=1)) as notes:
                    async for note in notes:
                        self._heard = time.monotonic()
                        if note.channel != self.own_channel:
                            await self._deliver(note.channel, note.payload, deliver)
            except asyncio.CancelledError:
                raise
            except self.errors as exc:
                self.outage.failed(exc)
                listener, self._listener = self._listener, None
                if listener is not None:
                    await discard(listener)
                self._fail_commands(exc)
                await asyncio.sleep(0.5)
            except Exception as exc:  # never stop receiving
                if type(exc) not in self._receive_errors:
                    self._receive_errors.add(type(exc))
                    logger.exception("receiving from the backplane failed; going on")
                await asyncio.sleep(0.1)

    async def _deliver(self, name: str, payload: str, deliver: Deliver) -> None:
        channel = self._names.get(name)
        if channel is None:
            return  # a channel this process left meanwhile
        try:
            if payload.startswith("p "):  # too large for a NOTIFY: in the table
                row = await self.pool.one("SELECT body FROM realtime_app_bp_payload WHERE id = %s", [int(payload[2:])])
                if row is None:
                    logger.warning("a large publication of %s was pruned before it was read", channel)
                    return
                payload = row[0]
            arrived = delivery(channel, payload.encode())
            if arrived.kind == "released" and arrived.text == self.instance_id:
                return  # its own release
            await deliver(arrived)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a delivery (or a payload unread) never stops the receiving
            if type(exc) not in self._receive_errors:
                self._receive_errors.add(type(exc))
                logger.exception("delivering a backplane message of %s failed; going on", channel)

    async def _command(self, verb: str, names: list[str]) -> None:
        """Have the receiver run ``verb`` on the listening connection, and wait for it."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._commands.append((verb, names, future))
        try:
            await self.pool.one("SELECT pg_notify(%s, 'w')", [self.own_channel])  # wakes the receiver
            await future
        except BaseException:
            future.cancel()  # (the receiver skips it)
            raise

    async def _run_commands(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Run the waiting commands in order and answer each caller. A command whose caller
        was cancelled before it ran is skipped (the hub's next beat asks again); one whose
        caller is cancelled while it runs is finished and the caller left alone. On a
        failure the command not run waits again, for the next connection."""
        while self._commands:
            verb, names, future = self._commands[0]
            if not future.done():
                async with asyncio.timeout(self.pool.timeout_s):
                    await self._listen(conn, verb, names)
                (self._listening.update if verb == "LISTEN" else self._listening.difference_update)(names)
                if not future.done():
                    future.set_result(None)
            self._commands.pop(0)

    def _fail_commands(self, exc: BaseException) -> None:
        commands, self._commands = self._commands, []
        for _, _, future in commands:
            if not future.done():
                future.set_exception(exc)

    async def check(self) -> bool:
        """False when the sentinel row lapsed — it is written only when absent, so once
        every ``REASSERT_INTERVAL_MS`` — the server lost its run (a crash), or the listening
        connection came back since the last check. Starts a prune when one is due."""
        was, run, _ = await self.pool.one(  # and an echo to this process's own listening connection
            "SELECT realtime_app_bp_put_new(%s, %s, '1', %s), realtime_app_bp_run(), pg_notify(%s, 'h')",
            [self.scope("alive"), self.instance_id, self.reassert_ms, self.own_channel],
        )
        if self._receiver is not None and time.monotonic() - self._heard > self.silent_s:
            await self._listen_anew()
        relistened, self._relistened = self._relistened, False
        run_id, self._run_id = self._run_id, run
        if time.monotonic() - self._pruned >= PRUNE_EVERY_S and (self._pruner is None or self._pruner.done()):
            self._pruned = time.monotonic()
            self._pruner = asyncio.get_running_loop().create_task(self._prune_all(), name="realtime-prune")
        return bool(was) and not relistened and run_id in (None, run)

    async def _listen_anew(self) -> None:
        """The listening connection heard none of the echoes of the last beats: it is dead
        without knowing it (a NAT or a proxy that dropped it silently, a frozen peer).
        Found: such a connection kept a process deaf for minutes while every call on the
        pool answered and the probe said "up". Close it; a new one listens to everything."""
        logger.warning(
            "the backplane's listening connection heard nothing for %.0f s (echoes included): opening another",
            time.monotonic() - self._heard,
        )
        receiver, self._receiver = self._receiver, None
        await cancel_and_wait(receiver)
        listener, self._listener = self._listener, None
        if listener is not None:
            await discard(listener)
        self._heard = time.monotonic()
        self._relistened = True  # what was sent meanwhile is gone: the hub re-asserts
        assert self._deliver_to is not None
        self._receiver = asyncio.get_running_loop().create_task(
            self._receive(self._deliver_to), name="realtime-receive"
        )

    async def prune(self) -> int:
        """Delete a batch of each kind of row past its end: how many went."""
        return int((await self.pool.one(PRUNE))[0])

    async def _prune_all(self) -> None:
        """Prune again at once while a batch was full, for at most ``PRUNE_BUDGET_S`` (off
        the beat: a prune of a large table never makes a beat late)."""
        until = time.monotonic() + PRUNE_BUDGET_S
        try:
            while await self.prune() >= PRUNE_BATCH and time.monotonic() < until:
                pass
        except self.errors:  # an outage: the beat says it; the next prune comes
            pass
        except Exception as exc:  # never a task that dies unheard
            if type(exc) not in self._receive_errors:
                self._receive_errors.add(type(exc))
                logger.exception("pruning the backplane's tables failed; the next prune comes")

    # -- groups and publications -----------------------------------------------------

    async def join(self, channels: list[str]) -> None:
        """Listen to each channel — not again to one the connection listens to."""
        names = {self.notify_channel(channel): channel for channel in channels}
        self._names.update(names)
        fresh = [name for name in names if name not in self._listening]
        if fresh:
            await self._command("LISTEN", fresh)

    async def leave(self, channel: str) -> None:
        name = self.notify_channel(channel)
        self._names.pop(name, None)
        await self._command("UNLISTEN", [name])

    async def publish(self, channel: str, data_json: str, floor: int = 0, history: HistoryPolicy | None = None) -> int:
        head = notification_head(channel, data_json)
        if history is None:
            row = await self.pool.one(
                "SELECT realtime_app_bp_publish(%s, %s, %s, %s, %s, %s)",
                [self.key("seq", channel), self.notify_channel(channel), floor, self.seq_ttl_ms, head, now_ms()],
            )
            return int(row[0])
        return await self.publish_kept(channel, head, floor, history)

    async def reseed(self, floors: dict[str, int]) -> None:
        if floors:
            keys = [self.key("seq", channel) for channel in floors]
            await self.pool.one(
                "SELECT realtime_app_bp_reseed(%s, %s, %s)", [keys, list(floors.values()), self.seq_ttl_ms]
            )
