"""The per-process hub: a facade over the rooms that each own one job.

Each process keeps, for every channel, the set of its own connections subscribed to it,
and tells its :class:`~realtime_app.hub.reconciler.Reconciler` when a channel gets its
first local subscriber or loses its last. The reconciler decides what to do on the
backplane (join, acquire, start the ticker, release, leave...) and
:class:`~realtime_app.hub.convergence.Convergence` carries it out, one action at a time
per channel; its beat renews leases, retries what failed and, after the backplane lost
its state, re-asserts everything, so delivery heals by itself.

Local state never waits for the backplane: a disconnect forgets its connection and
subscriptions at once, whatever Redis does; the backplane catches up at the next beat.
Frames arrive once per process and are fanned out locally, encoded once
(:mod:`~realtime_app.hub.fanout`), in order for channels with history
(:mod:`~realtime_app.hub.ordering`, :mod:`~realtime_app.hub.replay`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from realtime_app.cancellation import cancel_and_wait, uninterrupted
from realtime_app.cluster.base import Backplane, Delivery
from realtime_app.cluster.factory import make_backplane
from realtime_app.declarations.instances import InstanceBook
from realtime_app.declarations.registry import FED_PREFIX, RESERVED, ChannelSpec, registry
from realtime_app.exceptions import BackplaneUnavailable
from realtime_app.hub.connections import Connection
from realtime_app.hub.convergence import Convergence
from realtime_app.hub.current import CurrentValues
from realtime_app.hub.envelope import encode_publication
from realtime_app.hub.fanout import Fanout
from realtime_app.hub.fed import FedStates
from realtime_app.hub.gate import Gate
from realtime_app.hub.ordering import Ordering
from realtime_app.hub.outcomes import Outcomes
from realtime_app.hub.presence import Presence
from realtime_app.hub.probe import process_probe, process_start
from realtime_app.hub.reconciler import Reconciler
from realtime_app.hub.replay import Replays
from realtime_app.hub.replies import Replies
from realtime_app.hub.shares import ShareBook
from realtime_app.hub.start_checks import log_check_errors
from realtime_app.hub.tickers import Tickers
from realtime_app.inbound.admission import Admission
from realtime_app.inbound.workers import RequestPool
from realtime_app.persistence.write_behind import start_all as start_stores
from realtime_app.wire.history import HistoryPolicy, Since
from realtime_app.wire.protocol import CloseCode, encode

if TYPE_CHECKING:
    from realtime_app.observability.schema import ProcessProbe

__all__ = ["CONTROL_CHANNEL", "HUB_PARTS", "Connection", "Hub", "HubParts"]

logger = logging.getLogger("realtime_app.hub")

#: The cluster's control messages' channel (never a client's: the registry refuses it).
CONTROL_CHANNEL = RESERVED
#: After a failed start, the callers that waited for it get the same error for this long.
START_RETRY_S = 2.0
#: Where a starting hub finds the parts above it that it runs (:class:`HubParts`): named,
#: not imported, so that the hub knows nothing of the endpoint (docs/architecture.md).
HUB_PARTS = "realtime_app.endpoint.wiring.parts"


@dataclass(frozen=True)
class HubParts:
    """What every hub runs beside its own rooms: loops by task name, control handlers by
    message ``kind`` (:mod:`realtime_app.endpoint.wiring` lists them)."""

    loops: dict[str, Callable[[Hub], Coroutine[Any, Any, None]]] = field(default_factory=dict)
    handlers: dict[str, Callable[[Hub, dict[str, Any]], None]] = field(default_factory=dict)


class Hub:
    """Everything one process knows about its connections and channels (one event loop)."""

    def __init__(self) -> None:
        self.instance_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.started_at = process_start()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread_id = threading.get_ident()
        self.backplane: Backplane | None = None
        self.reconciler = Reconciler()
        self.connections: set[Connection] = set()
        self.subscribers: dict[str, set[Connection]] = {}
        self.specs: dict[str, ChannelSpec] = {}  # channels with local subscribers
        self.last_seq: dict[str, int] = {}  # highest seq seen per subscribed channel: the floor
        self.instances = InstanceBook()  # live instances of templates, cadences, tickers: counted
        self.template_published: dict[str, int] = {}  # publications per template, from this process
        self.published = 0
        self.refused: dict[str, int] = {"tickers": 0, "cadences": 0, "instances": 0, "revoked": 0}
        self.shares = ShareBook(self.refused)  # each identity's tickers and instances
        self.gate = Gate()
        self.outcomes = Outcomes(self.forget)  # what guards decided, for fan-out and replies
        self.fanout = Fanout(self.subscribers, self.connections, self.outcomes)
        self.replies = Replies(self.outcomes)  # answers to one connection, and the unread-answers rule
        self.ordering = Ordering(self.fanout.fanout)
        self.replays = Replays(self, self.fanout, self.ordering, self.gate.admission)
        self.tickers = Tickers(self)
        self.fed = FedStates(self)
        self.current = CurrentValues(self)  # the newest frame of each subscribed state channel
        self.presence = Presence(self)  # who is in each presence channel, and its watchers' diffs
        self.convergence = Convergence(self)
        self._tasks: list[asyncio.Task[Any]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._start_lock = asyncio.Lock()
        self._failed: tuple[float, BackplaneUnavailable] | None = None  # the last failed start
        self.started, self._closed = False, False
        self.parts = HubParts()  # read at start (HUB_PARTS)

    @property
    def admission(self) -> Admission:  # the admission books of this process
        return self.gate.admission

    @property
    def pool(self) -> RequestPool:  # the pool that runs admitted requests
        return self.gate.pool

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the backplane and start the background loops (idempotent). A start
        that fails raises :class:`BackplaneUnavailable`; the callers that waited for it get
        the same error for :data:`START_RETRY_S`, rather than each trying in turn."""
        async with self._start_lock:
            if self.started:
                return
            if self._closed:
                raise BackplaneUnavailable("start", RuntimeError("the hub of this loop was closed"))
            if self._failed is not None and time.monotonic() - self._failed[0] < START_RETRY_S:
                raise self._failed[1]
            self.loop = asyncio.get_running_loop()
            self.thread_id = threading.get_ident()
            self.parts = import_string(HUB_PARTS)()  # before anything is opened: nothing to undo
            start_stores()  # journals left by ended processes are written first
            # The server ran no checks: their errors are said here, once — before the
            # backplane, which a wrong setting keeps from starting (found: a misspelled
            # BACKPLANE showed only as a traceback per connection).
            await log_check_errors()
            try:
                self.backplane = self.gate.backplane = make_backplane(self.instance_id)
                await self.backplane.start(self._deliver)
            except BaseException as exc:  # not started: what it opened is closed (the next start makes a new one)
                with contextlib.suppress(Exception):
                    await self.backplane.stop()  # type: ignore[union-attr]
                if not isinstance(exc, Exception):
                    raise
                error = exc if isinstance(exc, BackplaneUnavailable) else BackplaneUnavailable("start", exc)
                if self._failed is None:  # once per outage
                    log = logger.error if isinstance(exc, ImproperlyConfigured) else logger.warning
                    log("hub %s cannot start, realtime down until it can: %s", self.instance_id, error)
                self._failed = (time.monotonic(), error)
                raise error from exc
            if self._failed is not None:
                logger.info("hub %s started after the backplane came back", self.instance_id)
                self._failed = None
            self.reconciler.subscribed(CONTROL_CHANNEL, ticker=False)  # wanted as long as the hub runs
            try:
                await self.convergence.converge(CONTROL_CHANNEL)
            except BaseException:  # cancelled (a request that started it went away), or failed:
                with contextlib.suppress(Exception):  # nothing of this start is left running
                    await self.backplane.stop()
                raise
            loops = [
                (self.tickers.publisher(), "realtime-publisher"),
                (self.convergence.maintain(), "realtime-maintain"),
                (self.presence.run(), "realtime-presence"),
            ]
            loops += [(loop(self), name) for name, loop in self.parts.loops.items()]
            for coro, name in loops:
                task = self.loop.create_task(coro, name=name)
                task.add_done_callback(_log_death)
                self._tasks.append(task)
            self.started = True
            logger.info("hub %s started on %s", self.instance_id, type(self.backplane).__name__)

    async def aclose(self) -> None:
        """Stop tickers, hand leases over, leave groups and stop the loops. A cancel (a
        caller's bound) cuts the leaving, never the stop of the loops and the backplane."""
        if not self.started:
            return
        self.started, self._closed = False, True
        self.pool.close()
        try:
            for conn in list(self.connections):
                await self.remove_connection(conn)
            await cancel_and_wait(*self._tasks)
            for withdraw in (self.presence.leave_all, self.backplane.drop_probe):  # type: ignore[union-attr]
                with contextlib.suppress(Exception):  # now, not a lease later
                    await withdraw()
        finally:
            await uninterrupted(self._stop())

    async def _stop(self) -> None:  # bounded: the loops honour a cancel, each close has its timeout
        await cancel_and_wait(*self._tasks)
        self._tasks.clear()
        await self.backplane.stop()  # type: ignore[union-attr]

    # -- connections and subscriptions --------------------------------------------------

    def add_connection(self, conn: Connection, identity: tuple[str, str] | None = None) -> str | None:
        """Count ``conn`` in; why not (and not added) when its identity is over its cap or
        the process over its ceiling (:meth:`Gate.enter`)."""
        if identity is not None:
            refused = self.gate.enter(identity)
            if refused is not None:
                return refused
            conn.identity = conn.owner = identity
        self.connections.add(conn)
        conn.guard.watch(self.fanout.watched, conn)
        return None

    async def remove_connection(self, conn: Connection) -> None:
        """Forget a connection and everything it subscribed, locally and at once; the
        backplane follows (now if it answers, else at a later beat)."""
        conn.closed = True
        self.fanout.watched.discard(conn)
        if conn in self.connections:
            self.connections.discard(conn)
            if conn.identity is not None:
                self.gate.leave(conn.identity)
        emptied = [channel for channel in list(conn.subscriptions) if self._drop_local(conn, channel)]
        conn.subscriptions.clear()
        for channel in emptied:
            await self.convergence.converge(channel)

    def _drop_local(self, conn: Connection, channel: str) -> bool:
        """Remove one local subscription; True when it was the channel's last."""
        self.presence.exit(conn, channel)
        self.shares.give(conn, channel)
        conn.subscriptions.discard(channel)
        conn.positions.pop(channel, None)
        if conn.guard.held:  # a conflated frame of a channel it left: never sent
            conn.guard.held.frames.pop(channel, None)
        if channel in conn.deltas:
            self.fanout.forget_deltas(conn, channel)
        subs = self.subscribers.get(channel)
        if subs is None:
            return False
        subs.discard(conn)
        if subs:
            return False
        del self.subscribers[channel]
        spec = self.specs.pop(channel, None)
        if spec is not None:
            self.instances.closed(spec)
        self.ordering.forget(channel)
        self.last_seq.pop(channel, None)
        self.current.forget(channel)
        self.tickers.book.failing.discard(channel)
        self.reconciler.unsubscribed(channel)
        return True

    def running_cadences(self, base: str) -> list[int]:  # of family ``base``, with local subscribers (ms)
        return sorted(self.instances.cadences.get(base, ()))

    def ticker_count(self) -> int:
        """Local channels that run something (a ticker, an app-fed cadence) holding a lease."""
        return self.instances.tickers

    def count_refusal(self, reason: str) -> None:  # the probe's ``refused`` (tickers, cadences, instances)
        self.refused[reason] += 1

    async def subscribe(self, conn: Connection, spec: ChannelSpec) -> bool:
        """Add ``conn`` to ``spec``'s subscribers; False if it already was one. Returns once
        the backplane has been asked to deliver the channel here; if it does not answer,
        the subscription stands and the next beats catch up."""
        channel = spec.name
        if conn.closed or channel in conn.subscriptions:
            return False
        self.shares.take(conn, conn.owner, spec)  # past its identity's share: refused here
        subs = self.subscribers.get(channel)
        if subs is None:
            subs = self.subscribers[channel] = set()
            self.specs[channel] = spec
            self.instances.opened(spec)
            self.reconciler.subscribed(channel, ticker=spec.has_ticker)
        subs.add(conn)
        conn.subscriptions.add(channel)
        if spec.presence:
            self.presence.enter(conn, spec)
        await self.convergence.converge(channel)
        return True

    async def converge(self, channel: str) -> None:  # what the reconciler wants of it, now
        await self.convergence.converge(channel)

    async def send_current(self, conn: Connection, spec: ChannelSpec) -> bool:
        """A new subscriber's current value at once (:class:`CurrentValues`)."""
        return await self.current.send(conn, spec)

    async def subscribe_kept(
        self, conn: Connection, spec: ChannelSpec, since: Since | None = None, deltas: bool = False
    ) -> dict[str, Any]:
        """Subscribe to a channel with history, or resume it (:mod:`~realtime_app.hub.replay`)."""
        return await self.replays.subscribe_kept(conn, spec, since, deltas)

    def undo_subscribe(self, conn: Connection, channel: str) -> None:
        """Take back a subscription that could not be completed."""
        if self._drop_local(conn, channel):
            self.spawn(self.convergence.converge(channel))

    async def unsubscribe(self, conn: Connection, channel: str) -> bool:
        """Remove ``conn`` from ``channel``; the last one out stops what the channel held."""
        if channel not in conn.subscriptions:
            return False
        if self._drop_local(conn, channel):
            await self.convergence.converge(channel)
        return True

    # -- delivery and control -----------------------------------------------------------

    async def _deliver(self, delivery: Delivery) -> None:
        channel = delivery.channel
        if delivery.kind == "frame" and channel == CONTROL_CHANNEL:
            self._on_control(delivery.text)
        elif delivery.kind == "frame" and channel.startswith(FED_PREFIX):
            self.fed.delivered(channel, delivery.text, delivery.seq)
        elif delivery.kind == "frame":
            if channel not in self.subscribers:
                return
            if delivery.seq and delivery.seq > self.last_seq.get(channel, 0):
                self.last_seq[channel] = delivery.seq
            spec = self.specs.get(channel)
            if spec is not None and spec.kind == "state":
                self.current.seen(channel, delivery.text, delivery.seq)
            if delivery.epoch:
                self.ordering.frame(channel, delivery.text, delivery.seq, delivery.epoch)
            else:
                self.fanout.fanout(channel, delivery.text, delivery.seq)
        elif delivery.kind == "released":
            self.reconciler.released_elsewhere(channel)
            if self.reconciler.next_action(channel) is not None:
                self.spawn(self.convergence.converge(channel))

    def _on_control(self, text: str) -> None:
        try:
            message = json.loads(text)["params"]["data"]
            kind = message["kind"]
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring a malformed control message")
            return
        if kind in ("resend", "current"):  # the hub's own: a ticker's value for a process that has none
            self.current.on_control(kind, message)
            return
        handler = self.parts.handlers.get(kind)
        if handler is None:
            logger.warning("ignoring a control message of an unknown kind")
            return
        handler(self, message)

    async def control(self, message: dict[str, Any]) -> None:
        """Send a control message to every process of the cluster, this one included."""
        if not self.started:
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

    def forget(self, conn: Connection) -> None:
        """Release a connection's subscriptions now, from synchronous code."""
        conn.closed = True
        self.spawn(self.remove_connection(conn))

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` in a task the hub keeps until it ends (closing waits for none)."""
        assert self.loop is not None
        task = self.loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def publish(self, channel: str, data: Any, history: HistoryPolicy | None = None) -> int:
        """Publish one message on ``channel``; returns its ``seq``. ``history``: how the
        backplane keeps it, when not the channel's own (an app-fed value's).

        Raises :class:`PublicationError` when ``data`` is not JSON,
        :class:`PublicationTooLarge` when the frame would exceed ``MAX_PUBLICATION_BYTES``
        (no ``seq`` is taken for either), :class:`BackplaneUnavailable` when the backplane
        does not answer.
        """
        if not self.started:
            await self.start()
        backplane = self.backplane
        assert backplane is not None
        data_json = encode_publication(channel, data)
        spec = self.specs.get(channel) or registry.find(channel.removeprefix(FED_PREFIX))
        if history is None and spec is not None:
            history = spec.history
        try:
            seq = await backplane.publish(channel, data_json, self.last_seq.get(channel, 0), history)
        except backplane.errors as exc:
            backplane.outage.failed(exc)
            raise BackplaneUnavailable("publish", exc) from exc
        self.convergence.rule.answered(recovered=backplane.outage.succeeded())
        if channel in self.subscribers and seq > self.last_seq.get(channel, 0):
            self.last_seq[channel] = seq
        self.published += 1
        if spec is not None and spec.declared is not None:
            pattern = spec.declared.pattern
            self.template_published[pattern] = self.template_published.get(pattern, 0) + 1
        return seq

    def probe(self) -> ProcessProbe:  # this process's counters (no decision is taken from them)
        return process_probe(self)

    async def cluster_probes(self) -> list[ProcessProbe]:
        """Every live process's probe, this one's fresh."""
        assert self.backplane is not None
        others = [p for p in await self.backplane.cluster_probes() if p.get("instance") != self.instance_id]
        return [self.probe(), *others]


def _log_death(task: asyncio.Task[Any]) -> None:  # a loop must never end while the hub runs: say so loudly
    if not task.cancelled() and task.exception() is not None:
        logger.error("%s stopped: %r", task.get_name(), task.exception(), exc_info=task.exception())
