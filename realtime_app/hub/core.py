"""The per-process hub: local subscriptions, tickers, publications and fan-out.

Each process keeps, for every channel, the set of its own connections subscribed to it,
and tells its :class:`~realtime_app.hub.reconciler.Reconciler` when a channel gets its first
local subscriber or loses its last. The reconciler decides what to do on the backplane
(join, acquire, start the ticker, release, leave...) and the hub only carries it out, one
action at a time per channel. A maintenance beat renews leases, retries what failed and,
after the backplane lost its state, re-asserts everything, so delivery heals by itself.

Local state never waits for the backplane: a disconnect forgets its connection and
subscriptions at once, whatever Redis does; the backplane catches up at the next beat.
Frames arrive once per process and are fanned out locally, encoded once; a failing send
to one connection closes that connection and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from realtime_app.cancellation import cancel_and_wait
from realtime_app.channels.registry import RESERVED, ChannelSpec, registry
from realtime_app.cluster.base import Backplane, Delivery, now_ms
from realtime_app.cluster.factory import make_backplane
from realtime_app.conf import get_config
from realtime_app.exceptions import BackplaneUnavailable, PublicationError, PublicationTooLarge, RPCError
from realtime_app.hub.reconciler import REMOTE, Action, Reconciler
from realtime_app.inbound.admission import Admission, AdmissionLimits, Refusal, RefusalBudget
from realtime_app.inbound.workers import RequestPool
from realtime_app.middleware import pools_probe
from realtime_app.observability.logsafe import safe
from realtime_app.outbound.backpressure import CLOSE, DROP, SEND, Decision, decide_send
from realtime_app.outbound.guard import BACKPRESSURE_REASON, Guard
from realtime_app.outbound.transports import text_frame
from realtime_app.persistence.write_behind import start_all as start_stores
from realtime_app.persistence.write_behind import stores_probe
from realtime_app.wire.history import PAGE, HistoryEntry, Since, follows, new_epoch, newer_epoch, plan_resume
from realtime_app.wire.protocol import OVERLOADED, CloseCode, encode, notification_text

__all__ = ["Connection", "Hub", "get_hub", "running_hub"]

logger = logging.getLogger("realtime_app.hub")

_connection_ids = itertools.count(1)

#: The backplane channel of the cluster's control messages (never a client's channel:
#: the registry refuses the name).
CONTROL_CHANNEL = RESERVED
_MISSING = object()


#: How long a replay may wait for a slow client to read (docs/recovery.md), and how many
#: live frames may wait for it meanwhile; past either, the resume answers ``too_slow``.
REPLAY_TIMEOUT_S = 10.0
REPLAY_MEASURE_BYTES = 64 * 1024
MAX_REPLAY_BUFFER = 10_000
#: Loops every hub runs beside its own while it is started, by task name: registered by the
#: modules that own them (sessions' re-validation), so that the hub imports none of them.
BACKGROUND_LOOPS: dict[str, Callable[[Hub], Coroutine[Any, Any, None]]] = {}
#: What a control message of each ``kind`` does in every process (sessions' ``logout``).
CONTROL_HANDLERS: dict[str, Callable[[Hub, dict[str, Any]], None]] = {}
#: Beats in a row whose check of the backplane timed out before it is logged as down.
SLOW_BEATS_DOWN = 2
#: Tokens a resume pays for each page of history it reads after the first, and when a
#: resume refused for ``MAX_CONCURRENT_RESUMES`` may come back.
RESUME_PAGE_COST = 1.0
RESUME_RETRY_MS = 1000
#: How long a frame of a channel with history that overtook an earlier one waits for it
#: before it is fanned out anyway (the subscribers then resume the gap).
REORDER_WINDOW_S = 0.05

#: Answers a connection over its backpressure threshold may still be written before its
#: requests stop running (docs/admission.md): enough for a slow client's small calls.
UNREAD_ANSWER_BYTES = 64 * 1024
#: Identities whose refusal budgets are remembered (the least recently refused forgotten first).
MAX_REFUSAL_BUDGETS = 10_000


@dataclass(eq=False, slots=True)
class Connection:
    """One WebSocket connection as the hub sees it: its guarded transport, its channels."""

    send: Callable[[dict[str, Any]], Any]
    scope: dict[str, Any] = field(default_factory=dict, repr=False)
    id: int = field(default_factory=lambda: next(_connection_ids))
    subscriptions: set[str] = field(default_factory=set)
    closed: bool = False
    identity: tuple[str, str] | None = None
    unread_bytes: int = 0  # answers written over the threshold since the queue was last under it
    #: Per channel with history: the (epoch, seq) last sent, below which nothing is sent again.
    positions: dict[str, tuple[str, int]] = field(default_factory=dict)
    guard: Guard = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.guard = Guard(self.send)


@dataclass(slots=True)
class _Order:
    """The frames of one channel with history as this process fans them out: in ``seq``
    order within an epoch, a frame that overtook an earlier one held for
    ``REORDER_WINDOW_S`` (one wait here instead of a resume by every subscriber)."""

    epoch: str
    next: int
    held: dict[int, tuple[str, int]] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class TickerPublish:
    """``publish(data)`` of one ticker channel (latest value wins, callable from any thread);
    ``publish.failed(exc)`` marks the ticker failing in the probe until the next value."""

    __slots__ = ("channel", "hub")

    def __init__(self, hub: Hub, channel: str) -> None:
        self.hub = hub
        self.channel = channel

    def __call__(self, data: Any) -> None:
        self._on_loop(self.hub._offer, data)

    def failed(self, exc: BaseException) -> None:
        self._on_loop(self.hub._tick_failed)

    def _on_loop(self, method: Callable[..., None], *args: Any) -> None:
        hub = self.hub
        if threading.get_ident() != hub._thread_id:
            assert hub.loop is not None
            hub.loop.call_soon_threadsafe(method, self.channel, *args)
        else:
            method(self.channel, *args)


class Hub:
    """Everything one process knows about its connections and channels (one event loop)."""

    def __init__(self) -> None:
        self.instance_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.started_at = _process_start()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.backplane: Backplane | None = None
        self.reconciler = Reconciler()
        self.admission = Admission(admission_limits())
        self.handshakes = Admission(handshake_limits())  # its buckets only: handshakes per identity
        self._refusing: set[tuple[str, str]] = set()  # identities whose handshakes are refused now
        self.pool = RequestPool(self.admission, get_config()["ADMISSION_MAX_RUNNING"], _execute)
        self._bucket_fallback: str | None = None  # why users' buckets are local now, if they are
        self.unread_refused = 0  # requests not run: their connection does not read its answers
        self.refusal_closes = 0  # connections closed (1008) for ignoring their refusals
        # Per identity, so that reconnecting does not refill it; least recently used first.
        self._refusal_budgets: OrderedDict[tuple[str, str], RefusalBudget] = OrderedDict()
        self.connections: set[Connection] = set()
        self.subscribers: dict[str, set[Connection]] = {}
        self.specs: dict[str, ChannelSpec] = {}  # channels with local subscribers
        self.identities: dict[tuple[str, str], int] = {}  # open connections per identity
        self.last_seq: dict[str, int] = {}  # highest seq seen per subscribed channel: the floor
        # Connections being given a channel's history: its live frames wait here meanwhile.
        self._replays: dict[str, dict[Connection, list[tuple[int, str, bytes]]]] = {}
        self._orders: dict[str, _Order] = {}  # channels with history: the next seq to fan out
        self.recoveries: dict[str, int] = {"served": 0, "failed": 0, "deferred": 0}
        self.resuming = 0  # resumes replaying now (MAX_CONCURRENT_RESUMES)
        self.replayed = 0  # publications sent again from a history
        self.history_gaps = 0  # publications of a channel with history that never reached this process
        self._cleanups: dict[str, Callable[[], Any] | None] = {}  # running tickers
        self._failing: set[str] = set()  # factories or publications failing (logged once)
        self._locks: dict[str, asyncio.Lock] = {}
        self._lock_users: dict[str, int] = {}  # converges holding or awaiting each lock
        self._lease_at: dict[str, float] = {}  # when each held lease was last granted or renewed
        self._pending: dict[str, Any] = {}  # latest unpublished value per ticker channel
        self._in_flight: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._start_lock = asyncio.Lock()
        self._started = False
        self._closed = False
        self._reassert = True
        self._slow_beats = 0  # beats in a row whose check timed out
        self._thread_id = threading.get_ident()
        self._background: set[asyncio.Task[Any]] = set()
        self.published = 0
        self.drops = 0  # frames refused by the guard, cumulative
        self.closes = 0  # connections closed with 1013 by the guard
        self.send_failures = 0  # connections closed because a send raised
        self.stale_ticks = 0  # ticks not published: the lease could not be renewed in time
        self.refused: dict[str, int] = {"tickers": 0, "cadences": 0, "connections": 0, "handshakes": 0, "revoked": 0}

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the backplane and start the background loops (idempotent)."""
        async with self._start_lock:
            if self._started:
                return
            if self._closed:
                raise BackplaneUnavailable("start", RuntimeError("the hub of this loop was closed"))
            self.loop = asyncio.get_running_loop()
            self._thread_id = threading.get_ident()
            start_stores()  # journals left by ended processes are written first
            self.backplane = make_backplane(self.instance_id)
            await self.backplane.start(self._deliver)
            self.reconciler.subscribed(CONTROL_CHANNEL, ticker=False)  # wanted as long as the hub runs
            await self._converge(CONTROL_CHANNEL)
            loops = [(self._publisher(), "realtime-publisher"), (self._maintain(), "realtime-maintain")]
            loops += [(loop(self), name) for name, loop in BACKGROUND_LOOPS.items()]
            for coro, name in loops:
                task = self.loop.create_task(coro, name=name)
                task.add_done_callback(_log_death)
                self._tasks.append(task)
            self._started = True
            logger.info("hub %s started on %s", self.instance_id, type(self.backplane).__name__)

    async def aclose(self) -> None:
        """Stop tickers, hand leases over, leave groups and stop the loops."""
        if not self._started:
            return
        self._started = False
        self._closed = True
        self.pool.close()
        for conn in list(self.connections):
            await self.remove_connection(conn)
        await cancel_and_wait(*self._tasks)
        self._tasks.clear()
        assert self.backplane is not None
        with contextlib.suppress(Exception):
            await self.backplane.drop_probe()
        await self.backplane.stop()

    # -- connections and subscriptions --------------------------------------------------

    def handshake(self, identity: tuple[str, str]) -> bool:
        """Count one handshake of ``identity``; False past ``HANDSHAKES_PER_S`` (reconnect
        churn: every reconnect of an identity draws on the same bucket)."""
        self.handshakes.forget_idle()  # memory follows the identities that connect now
        if not self.handshakes.limits.bucket_capacity or self.handshakes.charge(identity, 1.0) is None:
            self._refusing.discard(identity)
            return True
        self.refused["handshakes"] += 1
        if identity not in self._refusing:  # once until it slows down, not once per handshake
            if len(self._refusing) > 10_000:
                self._refusing.clear()
            self._refusing.add(identity)
            logger.info(
                "refusing the handshakes of one %s: over %s per second (counted in the probe)",
                identity[0],
                self.handshakes.limits.refill_per_s,
            )
        return False

    def add_connection(self, conn: Connection, identity: tuple[str, str] | None = None) -> bool:
        """Count ``conn`` in; False (and not added) when its identity is over its cap."""
        if identity is not None:
            config = get_config()
            cap = config["MAX_CONNECTIONS_PER_USER" if identity[0] == "user" else "MAX_CONNECTIONS_PER_ADDRESS"]
            if cap and self.identities.get(identity, 0) >= cap:
                self.refused["connections"] += 1
                return False
            self.identities[identity] = self.identities.get(identity, 0) + 1
            conn.identity = identity
        self.connections.add(conn)
        return True

    async def remove_connection(self, conn: Connection) -> None:
        """Forget a connection and everything it subscribed, locally and at once; the
        backplane follows (now if it answers, else at a later beat)."""
        conn.closed = True
        if conn in self.connections:
            self.connections.discard(conn)
            if conn.identity is not None:
                left = self.identities.get(conn.identity, 1) - 1
                if left > 0:
                    self.identities[conn.identity] = left
                else:
                    self.identities.pop(conn.identity, None)
        emptied = [channel for channel in list(conn.subscriptions) if self._drop_local(conn, channel)]
        conn.subscriptions.clear()
        for channel in emptied:
            await self._converge(channel)

    def _drop_local(self, conn: Connection, channel: str) -> bool:
        """Remove one local subscription; True when it was the channel's last."""
        conn.subscriptions.discard(channel)
        conn.positions.pop(channel, None)
        subs = self.subscribers.get(channel)
        if subs is None:
            return False
        subs.discard(conn)
        if subs:
            return False
        del self.subscribers[channel]
        self.specs.pop(channel, None)
        order = self._orders.pop(channel, None)
        if order is not None:
            order.stop()
        self.last_seq.pop(channel, None)
        self._failing.discard(channel)
        self.reconciler.unsubscribed(channel)
        return True

    def running_cadences(self, base: str) -> list[int]:
        """Cadences (ms) of family ``base`` with local subscribers in this process."""
        return sorted(s.interval_ms for s in self.specs.values() if s.base == base and s.interval_ms is not None)

    def ticker_count(self) -> int:
        """Ticker channels with local subscribers (each may run a ticker somewhere)."""
        return sum(1 for s in self.specs.values() if s.has_ticker)

    async def subscribe(self, conn: Connection, spec: ChannelSpec) -> bool:
        """Add ``conn`` to ``spec``'s subscribers; False if it already was one.

        Returns once the backplane has been asked to deliver the channel here; if it does
        not answer, the subscription stands and the next beats catch up.
        """
        channel = spec.name
        if conn.closed or channel in conn.subscriptions:
            return False
        subs = self.subscribers.get(channel)
        if subs is None:
            subs = self.subscribers[channel] = set()
            self.specs[channel] = spec
            self.reconciler.subscribed(channel, ticker=spec.has_ticker)
        subs.add(conn)
        conn.subscriptions.add(channel)
        await self._converge(channel)
        return True

    async def subscribe_kept(self, conn: Connection, spec: ChannelSpec, since: Since | None = None) -> dict[str, Any]:
        """Subscribe ``conn`` to a channel with history — or resume it, with ``since``.

        The publications after ``since`` are sent first, in order, then the live ones,
        none twice: live frames that arrive meanwhile wait in a buffer for this connection
        and go out after the replay, those the replay carried skipped. The replay is read
        a page at a time and paced by the connection's send queue (docs/recovery.md).
        Returns the channel's position ``{"epoch", "seq"}`` and, with ``since``,
        ``recovered`` and ``replayed``, or ``reason`` when the gap was not filled.
        """
        policy = spec.history
        backplane = self.backplane
        assert policy is not None and backplane is not None
        if since is not None:
            limit = get_config()["MAX_CONCURRENT_RESUMES"]
            if limit and self.resuming >= limit:
                self.recoveries["deferred"] += 1
                raise RPCError(
                    OVERLOADED, "Too many resumes", "too_many_resumes", limit=limit, retry_after_ms=RESUME_RETRY_MS
                )
            self.resuming += 1
        try:
            return await self._subscribe_kept(conn, spec, since)
        finally:
            if since is not None:
                self.resuming -= 1

    async def _subscribe_kept(self, conn: Connection, spec: ChannelSpec, since: Since | None) -> dict[str, Any]:
        policy = spec.history
        backplane = self.backplane
        assert policy is not None and backplane is not None
        channel = spec.name
        buffer: list[tuple[int, str, bytes]] = []
        self._replays.setdefault(channel, {})[conn] = buffer
        added = False
        try:
            added = await self.subscribe(conn, spec)
            read = await backplane.history(channel, policy, since, self.last_seq.get(channel, 0))
            self._sequencer(channel, read.epoch, read.top)
            at = conn.positions.get(channel)
            if at is None or at[0] != read.epoch or at[1] < read.top:
                conn.positions[channel] = (read.epoch, read.top)  # the replay brings it there
            answer: dict[str, Any] = {"epoch": read.epoch, "seq": read.top}
            if since is None:
                return answer
            plan = plan_resume(since, read, policy, now_ms())
            reason = plan.reason
            sent = 0
            if plan.recovered:
                sent, reason = await self._replay(conn, channel, plan.entries, since.seq, read.top, buffer)
            answer["recovered"] = not reason
            if reason:
                self.recoveries["failed"] += 1
                answer["reason"] = reason
            else:
                self.recoveries["served"] += 1
                answer["replayed"] = sent
            return answer
        except backplane.errors as exc:
            backplane.outage.failed(exc)
            # A first subscribe is undone (it is told it failed); a resume keeps the
            # subscription: frames go on and the client resumes again at the next one.
            if added and since is None and self._drop_local(conn, channel):
                self._spawn(self._converge(channel))
            buffer.clear()
            raise BackplaneUnavailable("history", exc) from exc
        except BaseException:  # a bug or a cancel: never a half-done subscription
            if added and self._drop_local(conn, channel):
                self._spawn(self._converge(channel))
            buffer.clear()
            raise
        finally:
            self._end_replay(conn, channel, buffer)

    async def _replay(
        self,
        conn: Connection,
        channel: str,
        entries: list[HistoryEntry],
        after: int,
        top: int,
        buffer: list[tuple[int, str, bytes]],
    ) -> tuple[int, str]:
        """Send the publications ``after`` .. ``top``: ``(sent, "")``, or why it stopped.

        Pages are read as they are needed; before each frame the connection's queue must
        be under half the backpressure threshold (a client that just had frames dropped
        gets its replay as fast as it reads, not dropped again), for at most
        ``REPLAY_TIMEOUT_S`` in all."""
        backplane = self.backplane
        assert backplane is not None
        guard = conn.guard
        calm = guard.config.max_backpressure // 2
        deadline = time.monotonic() + REPLAY_TIMEOUT_S
        sent = 0
        unmeasured = REPLAY_MEASURE_BYTES + 1  # the first frame waits for a calm queue
        while after < top:
            if not entries:
                if not await self._pay_page(conn, deadline):
                    return sent, "too_slow"
                entries = await backplane.history_page(channel, after, PAGE)
            entries = [e for e in entries if e.seq <= top]
            if not entries or not follows(entries, after):
                return sent, "too_old"  # trimmed while it was read
            for entry in entries:
                payload = entry.text.encode("utf-8")
                unmeasured += len(payload)
                if unmeasured > REPLAY_MEASURE_BYTES:  # the queue read every 64 KiB, not every frame
                    unmeasured = 0
                    while guard.measure and guard.buffered() > calm and not conn.closed:
                        if time.monotonic() > deadline or len(buffer) > MAX_REPLAY_BUFFER:
                            return sent, "too_slow"
                        await asyncio.sleep(0.02)
                if conn.closed or channel not in conn.subscriptions:
                    return sent, "closed"
                self._push(conn, payload)
                sent += 1
                self.replayed += 1
            after = entries[-1].seq
            entries = []
        return sent, ""

    async def _pay_page(self, conn: Connection, deadline: float) -> bool:
        """A page after the first costs its reader ``RESUME_PAGE_COST`` tokens of its
        identity's bucket in this process: a resume costs what it replays, and one that
        outruns its bucket waits for it (False past ``deadline``)."""
        if conn.identity is None:
            return True
        while (refusal := self.admission.charge(conn.identity, RESUME_PAGE_COST)) is not None:
            wait = refusal.retry_after_ms / 1000
            if time.monotonic() + wait > deadline or conn.closed:
                return False
            await asyncio.sleep(wait)
        return True

    def _end_replay(self, conn: Connection, channel: str, buffer: list[tuple[int, str, bytes]]) -> None:
        """Send what arrived live during a replay, in ``seq`` order, what it held skipped."""
        replays = self._replays.get(channel)
        if replays is not None:
            replays.pop(conn, None)
            if not replays:
                del self._replays[channel]
        for seq, epoch, payload in sorted(buffer, key=lambda item: (item[1], item[0])):
            if conn.closed or channel not in conn.subscriptions:
                return
            self._push_kept(conn, channel, seq, epoch, payload)

    def _push_kept(
        self, conn: Connection, channel: str, seq: int, epoch: str, payload: bytes, frame: bytes | None = None
    ) -> None:
        """A frame of a channel with history, unless this connection had it already: a
        replay sent it, or it arrives late (a frame queued for this process before it
        left the channel and joined again, a publisher overtaken by another, a frame of
        the history a newer epoch replaced)."""
        at = conn.positions.get(channel)
        if at is not None and (seq <= at[1] if epoch == at[0] else not newer_epoch(epoch, at[0])):
            return
        conn.positions[channel] = (epoch, seq)
        self._push(conn, payload, frame)

    async def unsubscribe(self, conn: Connection, channel: str) -> bool:
        """Remove ``conn`` from ``channel``; the last one out stops what the channel held."""
        if channel not in conn.subscriptions:
            return False
        if self._drop_local(conn, channel):
            await self._converge(channel)
        return True

    # -- carrying out the reconciler's actions ---------------------------------------------

    def _lock(self, channel: str) -> asyncio.Lock:
        lock = self._locks.get(channel)
        if lock is None:
            lock = self._locks[channel] = asyncio.Lock()
        return lock

    async def _converge(self, channel: str) -> None:
        """Carry out the channel's actions until it is settled or the backplane fails.
        Never raises: what failed is retried at the next beat."""
        backplane = self.backplane
        assert backplane is not None
        lock = self._lock(channel)
        self._lock_users[channel] = self._lock_users.get(channel, 0) + 1
        try:
            await self._converge_locked(channel, lock, backplane)
        finally:
            # A lock is forgotten only when nobody holds or awaits it (``locked()`` is
            # already False while waiters queue): else two converges would run at once.
            users = self._lock_users[channel] - 1
            if users:
                self._lock_users[channel] = users
            else:
                del self._lock_users[channel]
                if channel not in self.reconciler.channels:
                    self._locks.pop(channel, None)

    async def _converge_locked(self, channel: str, lock: asyncio.Lock, backplane: Backplane) -> None:
        async with lock:
            for _ in range(16):  # a settled channel needs at most a handful
                action = self.reconciler.next_action(channel)
                if action is None:
                    break
                try:
                    ok = await self._carry_out(channel, action)
                except asyncio.CancelledError:
                    raise
                except backplane.errors as exc:
                    backplane.outage.failed(exc)
                    self.reconciler.failed(channel, action)
                    break
                except Exception:
                    logger.exception("%s of %s failed", action.value, safe(channel))
                    self.reconciler.failed(channel, action)
                    break
                if action in REMOTE and backplane.outage.succeeded():
                    self._reassert = True
                if action in (Action.ACQUIRE, Action.RENEW):
                    if ok:
                        self._lease_at[channel] = time.monotonic()
                    else:
                        self._lease_at.pop(channel, None)
                self.reconciler.done(channel, action, ok)

    async def _carry_out(self, channel: str, action: Action) -> bool:
        backplane = self.backplane
        assert backplane is not None
        if action is Action.JOIN:
            await backplane.join([channel])
            return True
        if action is Action.LEAVE:
            await backplane.leave(channel)
            return True
        if action is Action.ACQUIRE:
            return await backplane.acquire(channel)
        if action is Action.RENEW:
            held = await backplane.renew(channel)
            if not held:
                logger.warning("lost the lease of %s; stopping its ticker", safe(channel))
            return held
        if action is Action.RELEASE:
            await backplane.release(channel)
            return True
        if action is Action.START:
            return await self._start_ticker(channel)
        await self._stop_ticker(channel)
        return True

    async def _converge_all(self, channels: list[str]) -> None:
        """Converge many channels, a bounded number at a time, each under its own lock."""
        slots = asyncio.Semaphore(max(1, get_config()["PUBLISH_CONCURRENCY"]))

        async def one(channel: str) -> None:
            async with slots:
                await self._converge(channel)

        await asyncio.gather(*(one(c) for c in channels))

    # -- tickers -----------------------------------------------------------------------

    async def _start_ticker(self, channel: str) -> bool:
        spec = self.specs.get(channel)
        if spec is None or spec.factory is None:
            return False
        self._cleanups[channel] = None
        try:
            result = spec.factory(spec, self._publisher_for(channel))
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError:
            self._cleanups.pop(channel, None)
            raise
        except Exception:
            self._cleanups.pop(channel, None)
            if channel not in self._failing:
                logger.exception("factory of %s failed; retrying at each beat", safe(channel))
                self._failing.add(channel)
            return False
        self._failing.discard(channel)
        self._cleanups[channel] = result if callable(result) else None
        logger.debug("ticker %s started on %s", channel, self.instance_id)
        return True

    async def _stop_ticker(self, channel: str) -> None:
        cleanup = self._cleanups.pop(channel, None)
        self._lease_at.pop(channel, None)
        self._pending.pop(channel, None)
        self._failing.discard(channel)
        if cleanup is None:
            return
        try:
            result = cleanup()
            if inspect.isawaitable(result):
                await result
        except Exception:
            logger.exception("cleanup of %s failed", safe(channel))

    def _publisher_for(self, channel: str) -> TickerPublish:
        """The ``publish(data)`` handed to a factory: latest value wins, thread-safe."""
        return TickerPublish(self, channel)

    def _offer(self, channel: str, data: Any) -> None:
        if channel in self._cleanups:
            self._pending[channel] = data
            self._wake.set()

    def _tick_failed(self, channel: str) -> None:
        if channel in self._cleanups:
            self._failing.add(channel)  # shown by the probe until a tick succeeds

    async def _publisher(self) -> None:
        """Send tickers' latest values; channels never wait behind each other."""
        slots = asyncio.Semaphore(max(1, get_config()["PUBLISH_CONCURRENCY"]))
        while True:
            await self._wake.wait()
            self._wake.clear()
            for channel in [c for c in self._pending if c not in self._in_flight]:
                await slots.acquire()
                data = self._pending.pop(channel, _MISSING)
                if data is _MISSING:
                    slots.release()
                    continue
                self._in_flight.add(channel)
                task = asyncio.get_running_loop().create_task(self._publish_tick(channel, data))

                def done(_: asyncio.Task[None], channel: str = channel) -> None:
                    slots.release()
                    self._in_flight.discard(channel)
                    if channel in self._pending:
                        self._wake.set()

                task.add_done_callback(done)

    def _lease_fresh(self, channel: str) -> bool:
        """True while this process may publish for ``channel``'s ticker: the lease was
        granted or renewed less than a lease TTL ago (in a cluster). A process cut off from
        the backplane stops publishing before another one can take the lease over."""
        backplane = self.backplane
        if backplane is None or not backplane.clustered:
            return True
        ttl_s: float = get_config()["LEASE_TTL_MS"] / 1000
        return time.monotonic() - self._lease_at.get(channel, float("-inf")) < ttl_s

    async def _publish_tick(self, channel: str, data: Any) -> None:
        if not self._lease_fresh(channel):
            self.stale_ticks += 1
            return
        try:
            await self.publish(channel, data)
        except BackplaneUnavailable:
            pass  # counted and logged by the outage
        except PublicationError as exc:
            if channel not in self._failing:
                logger.error("ticker of %s: %s", safe(channel), exc)
                self._failing.add(channel)
        except Exception:
            if channel not in self._failing:
                logger.exception("publication on %s failed", safe(channel))
                self._failing.add(channel)
        else:
            self._failing.discard(channel)

    async def _maintain(self) -> None:
        """The beat: notice lost backplane state, renew, compete, retry, re-assert; probe."""
        config = get_config()
        period = config["LEASE_TTL_MS"] / 3000
        probe_every = max(1, round(config["PROBE_TTL_MS"] / 3 / (period * 1000)))
        backplane = self.backplane
        assert backplane is not None
        for beat in itertools.count():
            try:
                await self._beat(backplane)
                if beat % probe_every == 0:
                    await backplane.put_probe(self.probe(), config["PROBE_TTL_MS"])
            except asyncio.CancelledError:
                raise
            except backplane.errors as exc:
                backplane.outage.failed(exc)
            except Exception:
                logger.exception("hub maintenance failed; retrying")
            await asyncio.sleep(period)

    async def _beat(self, backplane: Backplane) -> None:
        period = get_config()["LEASE_TTL_MS"] / 3000
        unreachable: tuple[type[BaseException], ...] = (*backplane.errors, TimeoutError)
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that
            # lands as check() returns, and the beat then outlives aclose() forever.
            async with asyncio.timeout(max(period, 0.5)):
                intact = await backplane.check()
        except unreachable as exc:
            self._reassert = True
            # One slow answer is a busy machine as often as a dead Redis: the outage is
            # declared by an error, or by a second slow beat in a row.
            self._slow_beats = self._slow_beats + 1 if isinstance(exc, TimeoutError) else SLOW_BEATS_DOWN
            if self._slow_beats >= SLOW_BEATS_DOWN:
                backplane.outage.failed(exc)
            return
        self._slow_beats = 0
        if backplane.outage.succeeded() or not intact:
            self._reassert = True
        reassert, self._reassert = self._reassert, False
        self.reconciler.beat(reassert=reassert)
        if reassert:
            await backplane.reseed({c: s for c, s in self.last_seq.items() if c in self.subscribers})
        await self._converge_all(list(self.reconciler.pending()))

    # -- delivery ----------------------------------------------------------------------

    async def _deliver(self, delivery: Delivery) -> None:
        if delivery.kind == "frame" and delivery.channel == CONTROL_CHANNEL:
            self._on_control(delivery.text)
        elif delivery.kind == "frame":
            if delivery.seq and delivery.channel in self.subscribers:
                if delivery.seq > self.last_seq.get(delivery.channel, 0):
                    self.last_seq[delivery.channel] = delivery.seq
            if delivery.epoch:
                self._in_order(delivery.channel, delivery.text, delivery.seq, delivery.epoch)
            else:
                self.fanout(delivery.channel, delivery.text, delivery.seq)
        elif delivery.kind == "released":
            self.reconciler.released_elsewhere(delivery.channel)
            if self.reconciler.next_action(delivery.channel) is not None:
                self._spawn(self._converge(delivery.channel))

    def _sequencer(self, channel: str, epoch: str, top: int) -> None:
        """Start ordering ``channel`` after ``top`` unless frames of it already flow here."""
        order = self._orders.get(channel)
        if channel in self.subscribers and (order is None or order.epoch != epoch):
            if order is not None:  # a fresh read is authoritative about the epoch
                order.stop()
            self._orders[channel] = _Order(epoch, top + 1)

    def _in_order(self, channel: str, text: str, seq: int, epoch: str) -> None:
        """Fan a frame of a channel with history out in ``seq`` order (see :class:`_Order`)."""
        order = self._orders.get(channel)
        if channel not in self.subscribers:
            return
        if order is None or newer_epoch(epoch, order.epoch):  # the first frame here, or a new history
            if order is not None:
                order.stop()
            order = self._orders[channel] = _Order(epoch, seq)
        elif epoch != order.epoch:
            return  # a late frame of a replaced history
        elif seq < order.next:
            # Late (after the window, or before a read set ``next``): each connection's
            # position decides whether it still needs it.
            self.fanout(channel, text, seq, epoch)
            return
        if seq > order.next:
            order.held[seq] = (text, seq)
            if order.timer is None:
                assert self.loop is not None
                order.timer = self.loop.call_later(REORDER_WINDOW_S, self._release, channel, order)
            return
        self.fanout(channel, text, seq, epoch)
        order.next = seq + 1
        while (held := order.held.pop(order.next, None)) is not None:
            self.fanout(channel, held[0], held[1], epoch)
            order.next += 1
        if not order.held:
            order.stop()

    def _release(self, channel: str, order: _Order) -> None:
        """The window passed: fan out what was held, over the gap (subscribers resume it)."""
        order.timer = None
        if self._orders.get(channel) is not order:
            return
        for seq in sorted(order.held):
            text, _ = order.held.pop(seq)
            self.history_gaps += max(0, seq - order.next)
            self.fanout(channel, text, seq, order.epoch)
            order.next = seq + 1

    def _on_control(self, text: str) -> None:
        try:
            message = json.loads(text)["params"]["data"]
            kind = message["kind"]
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring a malformed control message")
            return
        handler = CONTROL_HANDLERS.get(kind)
        if handler is None:
            logger.warning("ignoring a control message of an unknown kind")
            return
        handler(self, message)

    async def control(self, message: dict[str, Any]) -> None:
        """Send a control message to every process of the cluster, this one included."""
        if not self._started:
            await self.start()
        backplane = self.backplane
        assert backplane is not None
        try:
            await backplane.publish(CONTROL_CHANNEL, encode(message))
        except backplane.errors as exc:
            backplane.outage.failed(exc)
            raise BackplaneUnavailable("control", exc) from exc

    def revoke(self, conn: Connection, code: int) -> None:
        """Close ``conn`` because its rights ended (4001 session ended, 4003 revoked)."""
        if conn.closed:
            return
        self.refused["revoked"] += 1
        reason = "session ended" if code == CloseCode.SESSION_ENDED else "rights revoked"
        logger.info("connection %s closed with %s: %s", conn.id, code, reason)
        with contextlib.suppress(Exception):
            conn.guard.close(code, reason)
        self.forget(conn)

    def fanout(self, channel: str, text: str, seq: int = 0, epoch: str = "") -> None:
        """Hand one encoded frame to every local subscriber of ``channel``, guarded. A frame
        of a channel with history (``epoch``) goes to each connection once, in order, and
        after its replay (see :meth:`subscribe_kept`)."""
        subs = self.subscribers.get(channel)
        if not subs:
            return
        payload = text.encode("utf-8")  # once per publication, not per subscriber
        frame = text_frame(payload)  # the same bytes on every subscriber's socket
        if epoch:
            replays = self._replays.get(channel, {})
            for conn in tuple(subs):
                buffer = replays.get(conn)
                if buffer is not None:
                    buffer.append((seq, epoch, payload))
                else:
                    self._push_kept(conn, channel, seq, epoch, payload, frame)
            return
        for conn in tuple(subs):
            try:
                decision = conn.guard.send(payload, frame=frame)
            except Exception as exc:
                self._send_failed(conn, exc)
                continue
            if decision is not SEND:
                self._account(conn, decision)

    def _push(self, conn: Connection, payload: bytes, frame: bytes | None = None) -> None:
        """One frame of a channel to one connection, guarded (as :meth:`fanout` does)."""
        try:
            decision = conn.guard.send(payload, frame=frame if frame is not None else text_frame(payload))
        except Exception as exc:
            self._send_failed(conn, exc)
            return
        if decision is not SEND:
            self._account(conn, decision)

    def send_to(self, conn: Connection, text: str, *, response: bool = False) -> Decision:
        """Send one frame to one connection through its guard (RPC responses, errors)."""
        payload = text.encode("utf-8")
        try:
            decision = conn.guard.send(payload, response=response, frame=text_frame(payload))
        except Exception as exc:
            self._send_failed(conn, exc)
            return CLOSE
        if decision is not SEND:
            if response and decision is DROP and conn.guard.never_drop_responses:
                conn.unread_bytes += len(payload)  # written all the same: it counts
            self._account(conn, decision)
        return decision

    # -- admission ----------------------------------------------------------------------

    async def admit(self, identity: tuple[str, str], cost: float, *, merged: bool = False) -> Refusal | None:
        """Admit one request (docs/admission.md): the caps here, then the bucket — the
        cluster's, shared by a user's processes, on a backplane that keeps one; else this
        process's, and the probe says why."""
        admission = self.admission
        refusal = admission.reserve(identity, merged=merged)
        if refusal is not None:
            return refusal
        limits = admission.limits
        try:
            if (
                identity[0] == "user"
                and limits.bucket_capacity
                and self.backplane is not None
                and self.backplane.clustered
            ):
                refusal = await self._take_shared(identity, cost)
            else:
                refusal = admission.charge(identity, cost)
        except BaseException:  # cancelled while the shared bucket answered: give the slot back
            admission.cancel(identity, merged=merged)
            raise
        if refusal is not None:
            admission.cancel(identity, merged=merged)
        else:
            admission.confirm(merged=merged)
        return refusal

    async def _take_shared(self, identity: tuple[str, str], cost: float) -> Refusal | None:
        assert self.backplane is not None
        limits = self.admission.limits
        try:
            wait_ms = await self.backplane.take_tokens(
                f"{identity[0]}:{identity[1]}", cost, limits.bucket_capacity, limits.refill_per_s
            )
        except NotImplementedError:
            self._bucket_fallback = "the backplane shares no buckets"
            return self.admission.charge(identity, cost)
        except self.backplane.errors:  # the outage is logged by the beat
            self._bucket_fallback = "backplane unreachable"
            return self.admission.charge(identity, cost)
        self._bucket_fallback = None
        return None if wait_ms is None else self.admission.rate_limited(wait_ms)

    def spend_refusal(self, identity: tuple[str, str]) -> bool:
        """Count one refusal of ``identity`` against ``ADMISSION_CLOSE_AFTER_REFUSALS``;
        False when its budget is spent (close the connection: it ignores its refusals)."""
        budgets = self._refusal_budgets
        budget = budgets.get(identity)
        if budget is None:
            budget = budgets[identity] = RefusalBudget(float(get_config()["ADMISSION_CLOSE_AFTER_REFUSALS"]))
            while len(budgets) > MAX_REFUSAL_BUDGETS:
                budgets.popitem(last=False)
        else:
            budgets.move_to_end(identity)
        return budget.spend(time.monotonic())

    @property
    def shared_bucket(self) -> str:
        """Where users' buckets live: ``"shared"`` (the cluster's), ``"local"`` (one
        process, no cluster), or ``"local (why)"`` while the backplane cannot share them."""
        if self.backplane is None or not self.backplane.clustered:
            return "local"
        return "shared" if self._bucket_fallback is None else f"local ({self._bucket_fallback})"

    def unread_responses(self, conn: Connection) -> bool:
        """True when the requests of ``conn``'s next frame must not run: its queue is over
        the threshold *and* the answers written since it went over reach
        ``UNREAD_ANSWER_BYTES``. The client does not read; each such frame counts as a
        dropped frame toward its 1013. A client that is only slow still gets small answers
        through (the adaptive client's subscribe to a slower cadence, a ping), while what
        the server holds stays within the threshold plus that budget plus one answer,
        whatever the client sends."""
        guard = conn.guard
        if conn.closed:
            return True
        if not guard.measure:
            return False
        buffered = guard.buffered()
        if buffered <= guard.config.max_backpressure:
            conn.unread_bytes = 0
            return False
        if conn.unread_bytes < UNREAD_ANSWER_BYTES:
            return False
        decision = decide_send(buffered, guard.config, guard.state)
        self.unread_refused += 1
        if decision is CLOSE:
            guard.close(CloseCode.TRY_AGAIN_LATER, BACKPRESSURE_REASON)
        self._account(conn, decision)
        return True

    def _send_failed(self, conn: Connection, exc: Exception) -> None:
        """A send raised (the server refused the frame): close that connection, only it."""
        if conn.closed:
            return
        self.send_failures += 1
        logger.warning(
            "connection %s closed with %s: a send failed (%s: %s)",
            conn.id,
            int(CloseCode.INTERNAL_ERROR),
            type(exc).__name__,
            safe(exc, 200),
        )
        with contextlib.suppress(Exception):
            conn.guard.close(CloseCode.INTERNAL_ERROR, "send failed")
        self.forget(conn)

    def _account(self, conn: Connection, decision: Decision) -> None:
        if decision is DROP:
            self.drops += 1
        elif decision is CLOSE and not conn.closed:
            self.closes += 1
            logger.warning(
                "connection %s closed with %s: backpressure (%s bytes queued, %s drops)",
                conn.id,
                int(CloseCode.TRY_AGAIN_LATER),
                conn.guard.buffered(),
                conn.guard.state.drops,
            )
            self.forget(conn)

    def _spawn(self, coro: Any) -> None:
        assert self.loop is not None
        task = self.loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def forget(self, conn: Connection) -> None:
        """Release a connection's subscriptions now, from synchronous code."""
        conn.closed = True
        self._spawn(self.remove_connection(conn))

    async def publish(self, channel: str, data: Any) -> int:
        """Publish one message on ``channel``; returns its ``seq``.

        Raises :class:`PublicationError` when ``data`` is not JSON,
        :class:`PublicationTooLarge` when the frame would exceed ``MAX_PUBLICATION_BYTES``
        (no ``seq`` is taken for either), :class:`BackplaneUnavailable` when the backplane
        does not answer.
        """
        if not self._started:
            await self.start()
        backplane = self.backplane
        assert backplane is not None
        data_json = encode_publication(channel, data)
        spec = self.specs.get(channel) or registry.exact.get(channel)
        history = spec.history if spec is not None else None
        try:
            seq = await backplane.publish(channel, data_json, self.last_seq.get(channel, 0), history)
        except backplane.errors as exc:
            backplane.outage.failed(exc)
            raise BackplaneUnavailable("publish", exc) from exc
        if backplane.outage.succeeded():
            self._reassert = True
        if channel in self.subscribers and seq > self.last_seq.get(channel, 0):
            self.last_seq[channel] = seq
        self.published += 1
        return seq

    # -- probe -------------------------------------------------------------------------

    def backpressure_probe(self) -> dict[str, int]:
        """Queued bytes per connection, read now from the transports (no decision taken)."""
        slow = get_config()["SLOW_CONSUMER_BYTES"]
        worst = total = slow_count = balance = 0
        for conn in self.connections:
            queued = conn.guard.buffered()
            total += queued
            worst = max(worst, queued)
            balance = max(balance, conn.guard.state.balance)
            if slow and queued >= slow:
                slow_count += 1
        return {
            "max_buffered_amount": worst,
            "max_drop_balance": balance,
            "total_buffered_amount": total,
            "slow_consumers": slow_count,
            "drops": self.drops,
            "closes": self.closes,
        }

    def history_probe(self, top: int) -> dict[str, Any]:
        """Channels with history as this process last saw them, and its recoveries."""
        seen = self.backplane.histories if self.backplane is not None else {}
        busiest = sorted(seen.items(), key=lambda item: (-item[1][1], item[0]))[:top]
        return {
            "channels": {name: {"epoch": epoch, "kept": kept} for name, (epoch, kept) in busiest},
            "recoveries": dict(self.recoveries),
            "replayed": self.replayed,
            "gaps": self.history_gaps,
        }

    def probe(self) -> dict[str, Any]:
        """This process's counters (no decision is taken from them). Its size is bounded:
        the busiest ``PROBE_TOP_CHANNELS`` channels by name, the others counted."""
        top = get_config()["PROBE_TOP_CHANNELS"]
        busiest = sorted(self.subscribers.items(), key=lambda item: (-len(item[1]), item[0]))[:top]
        backplane = self.backplane
        return {
            "instance": self.instance_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "connections": len(self.connections),
            "subscriptions": sum(len(s) for s in self.subscribers.values()),
            "channels": {name: len(subs) for name, subs in busiest},
            "channel_count": len(self.subscribers),
            "tickers": sorted(self._cleanups)[:top],
            "ticker_count": len(self._cleanups),
            "failing_tickers": sorted(self._failing)[:top],
            "published": self.published,
            "refused": dict(self.refused),
            "admission": {
                "pending": self.admission.pending,
                "queued": self.pool.waiting,
                "running": self.pool.running,
                "admitted": self.admission.admitted,
                "completed": self.pool.completed,
                "coalesced": self.pool.merges,
                "abandoned": self.pool.abandoned,
                "refused": {**self.admission.refused, "unread_responses": self.unread_refused},
                "identities": self.admission.identities,
                "bucket": self.shared_bucket,
                "closed_for_refusals": self.refusal_closes,
            },
            "history": self.history_probe(top),
            "send_failures": self.send_failures,
            "stale_ticks": self.stale_ticks,
            "backplane": {
                "up": not (backplane is not None and backplane.outage.down),
                "outages": backplane.outage.outages if backplane is not None else 0,
            },
            "backpressure": self.backpressure_probe(),
            "http_pools": pools_probe(),
            "write_behind": stores_probe(),
        }

    async def cluster_probes(self) -> list[dict[str, Any]]:
        """Every live process's probe, this one's fresh."""
        assert self.backplane is not None
        others = [p for p in await self.backplane.cluster_probes() if p.get("instance") != self.instance_id]
        return [self.probe(), *others]


def admission_limits() -> AdmissionLimits:
    """The admission limits of ``REALTIME_APP`` (checked by ``realtime_app.E006``)."""
    config = get_config()
    return AdmissionLimits(
        max_pending=config["ADMISSION_MAX_PENDING"],
        max_per_identity=config["ADMISSION_MAX_PER_IDENTITY"],
        bucket_capacity=float(config["ADMISSION_BUCKET_CAPACITY"]),
        refill_per_s=float(config["ADMISSION_REFILL_PER_S"]),
    )


def handshake_limits() -> AdmissionLimits:
    """The handshake bucket of each identity (``HANDSHAKES_PER_S``, ``HANDSHAKE_BURST``)."""
    config = get_config()
    rate = float(config["HANDSHAKES_PER_S"])
    return AdmissionLimits(
        max_pending=0,
        max_per_identity=0,
        bucket_capacity=float(config["HANDSHAKE_BURST"]) if rate else 0.0,
        refill_per_s=rate,
    )


async def _execute(owner: Any, method: str, params: Any) -> Any:
    return await owner.execute(method, params)


def _log_death(task: asyncio.Task[Any]) -> None:
    """A background loop must never end while the hub runs: say so loudly if one does."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("%s stopped: %r", task.get_name(), task.exception(), exc_info=task.exception())


def encode_publication(channel: str, data: Any) -> str:
    """``data`` as JSON text, checked before any ``seq`` is taken: a publication that cannot
    be sent must not burn a number."""
    try:
        data_json = encode(data)
    except (ValueError, TypeError) as exc:
        raise PublicationError(channel, f"data is not JSON ({exc})") from None
    limit, bound = get_config()["MAX_PUBLICATION_BYTES"], "MAX_PUBLICATION_BYTES"
    spec = registry.exact.get(channel)
    if spec is not None and spec.max_bytes and (not limit or spec.max_bytes < limit):
        limit, bound = spec.max_bytes, "the channel's max_bytes"
    size = len(data_json) if data_json.isascii() else len(data_json.encode("utf-8"))
    size += len(encode(channel)) + ENVELOPE_BYTES
    if limit and size > limit:
        raise PublicationTooLarge(channel, size, limit, bound)
    return data_json


#: The bytes a ``message`` notification adds around its channel and data, at the largest
#: ``seq``, ``epoch`` and ``ts`` it can carry: the bound is on the whole frame.
ENVELOPE_BYTES = len(notification_text("", "", 2**63 - 1, 10**13 - 1, new_epoch()))


def _process_start() -> float:
    """When this process started (uptime is the process's, not the hub's)."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return time.time()


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Hub] = weakref.WeakKeyDictionary()


async def get_hub() -> Hub:
    """The started hub of the running event loop (created on first use)."""
    loop = asyncio.get_running_loop()
    hub = _hubs.get(loop)
    if hub is None:
        hub = _hubs[loop] = Hub()
    if not hub._started:
        await hub.start()
    return hub


def running_hub() -> Hub | None:
    """A started hub of this process on another live loop, for publishing from threads."""
    for loop, hub in list(_hubs.items()):
        if hub._started and loop.is_running() and not loop.is_closed():
            return hub
    return None


def hub_of_current_loop() -> Hub | None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    hub = _hubs.get(loop)
    return hub if hub is not None and hub._started else None
