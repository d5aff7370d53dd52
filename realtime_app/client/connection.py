"""An asyncio client of the realtime endpoint, the twin of the browser module.

Same features as ``RealtimeClient`` in ``realtime.js``: JSON-RPC calls with timeouts,
subscriptions with handlers kept across reconnects (resumed where a channel keeps a
history), capped jittered exponential backoff on transient close codes. A thin adapter:
the protocol's state is the session's (:class:`~realtime_app.wire.session.ClientSession`),
the socket's the :class:`~realtime_app.client.reconnecting.ReconnectingSocket`'s. The
adaptive cadence is :mod:`.adaptive_channel`, the operators' CLI :mod:`.cli`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import websockets

from realtime_app.client.reconnecting import RECONNECT_CODES, Hooks, ReconnectingSocket, is_reconnectable_close_code
from realtime_app.exceptions import OutcomeUnknown, Refused, RPCError, error_from_response
from realtime_app.wire.retry import RENEWAL_RETRY_REASONS, retry_delay_ms
from realtime_app.wire.session import Answer, ClientSession, Deliver, Event, Notify, Recover, Resubscribe

__all__ = ["RECONNECT_CODES", "Handler", "RealtimeClient", "Refused", "is_reconnectable_close_code"]

logger = logging.getLogger("realtime_app.client")

#: Seconds a resume (``subscribe`` with ``since``) may take: its replay comes first, as
#: fast as this client reads it.
RESUME_TIMEOUT = 60.0

Handler = Callable[[dict[str, Any]], Awaitable[None] | None]


def now_ms() -> float:
    return time.monotonic() * 1000


def _fire(callbacks: list[Callable[..., Any]], what: str, *args: Any) -> None:
    for callback in list(callbacks):
        try:
            callback(*args)
        except Exception:
            logger.exception("%s callback failed", what)


async def _deliver(handlers: list[tuple[str, Handler]], params: dict[str, Any]) -> None:
    """Hand a message to each handler in turn (sync or async), in the reading task."""
    for name, handler in handlers:
        try:
            result = handler(params)
            if inspect.isawaitable(result):
                await result
        except Exception:
            logger.exception("handler of %s failed", name)


def _settle(future: asyncio.Future[Any] | None, answer: Answer | Exception) -> None:
    if future is not None and not future.done():
        if isinstance(answer, Exception):
            future.set_exception(answer)
        elif answer.ok:
            future.set_result(answer.value)
        else:
            future.set_exception(error_from_response(answer.value))


class RealtimeClient:
    """One logical connection that reconnects by itself until :meth:`close`.

    Handlers run in the reading task, one frame at a time: a slow handler slows the
    reading down, as a slow browser tab would (and the server's backpressure sees it).

    Args:
        url: ``ws://host/realtime/`` or ``wss://…``.
        origin: the Origin header (default: the URL's host over http/https).
        headers: extra handshake headers (``{"Cookie": "sessionid=…"}``).
        token, refresh_token: a connection token (sent as ``Authorization: Bearer``) and a
            callable (sync or async) giving a new one when the server says it expires.
        call_timeout: seconds before a call fails; backoff_initial, backoff_max: reconnect
            delays in seconds (capped, jittered); connect_kwargs: to ``websockets.connect``.
        transport: ``"websocket"``, or ``"sse"`` (Server-Sent Events and HTTP RPC, for networks
            that break WebSockets: docs/sse.md; presence diffs and deltas are the socket's).
    """

    def __init__(
        self,
        url: str,
        *,
        origin: str | None = None,
        headers: dict[str, str] | None = None,
        token: str | None = None,
        refresh_token: Callable[[], Awaitable[str] | str] | None = None,
        call_timeout: float = 10.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        transport: str = "websocket",
        **connect_kwargs: Any,
    ) -> None:
        self.url = url
        self.origin = origin or f"{'https' if url.startswith('wss') else 'http'}://{url.split('/')[2]}"
        self.call_timeout, self.refresh_token = call_timeout, refresh_token
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        headers = {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}
        self.state = "closed"
        self.last_close: tuple[int | None, str] | None = None
        self.on_state: list[Callable[[str], None]] = []
        self.on_close: list[Callable[[int | None, str, bool], None]] = []
        #: Called with ``(channel, error)`` for every refused subscribe, renewals included.
        self.on_subscribe_error: list[Callable[[str, Exception], None]] = []
        #: Channels with history (docs/recovery.md): ``on_resync(channel, {"epoch", "seq",
        #: "reason"})`` when messages were missed for good (reload the state);
        #: ``on_recovered(channel, replayed)`` when a resume filled a gap.
        self.on_resync: list[Callable[[str, dict[str, Any]], None]] = []
        self.on_recovered: list[Callable[[str, int], None]] = []
        #: Presence (docs/presence.md): ``on_presence(channel, diff)`` for each ``presence``
        #: frame of a channel subscribed ``presence=True``; the members kept: :meth:`members`.
        self.on_presence: list[Callable[[str, dict[str, Any]], None]] = []
        #: Called with the server's answer of every accepted subscribe, renewals included.
        self.on_subscribed: list[Callable[[dict[str, Any]], None]] = []
        self.session = ClientSession()
        hooks = Hooks(self._set_state, self._resubscribe, self._on_text, self._closed, partial(_renew, self))
        backoff = lambda: (self.backoff_initial, self.backoff_max)  # noqa: E731  (read at each reconnect)
        self.transport = transport
        self.socket = ReconnectingSocket(url, self.origin, headers, backoff, connect_kwargs, hooks, transport)
        self._answers: dict[int, asyncio.Future[Any]] = {}
        self._renewals: dict[str, list[asyncio.Future[Any]]] = {}  # subscribe()s a reconnect's renewal answers
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def attempt(self) -> int:  # reconnects since the last open connection
        return self.socket.attempt

    async def __aenter__(self) -> RealtimeClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _set_state(self, state: str) -> None:
        if state == self.state == "closed":  # a close after the server's is no news
            return
        self.state = state
        _fire(self.on_state, "state", state)

    async def connect(self, timeout: float = 10.0) -> None:
        """Start the connection loop and wait until the first connection is open:
        ``ConnectionRefusedError`` as soon as the loop ends for good instead (a final close:
        a refused origin or token, the reason in :attr:`last_close`), ``TimeoutError`` after
        ``timeout`` while it is still trying."""
        self.socket.start()
        await self.socket.first_open(timeout)

    async def close(self, code: int = 1000) -> None:
        """Close for good (with ``code``): no reconnect."""
        for task in list(self._background):
            task.cancel()
        await self.socket.stop(code)
        self._lost(code)  # even when the loop was stopped before it heard the close
        _fail_renewals(self, OutcomeUnknown(f"closed ({code}): not subscribed"))
        self._set_state("closed")

    async def reconnect(self, delay_ms: float = 0) -> None:
        """Drop the connection, open a new one after ``delay_ms``: a blip (resubscribed, resumed)."""
        await self.socket.reconnect(delay_ms)

    async def wait_open(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self.socket.opened.wait(), timeout)

    def _closed(self, code: int | None, reason: str, again: bool) -> None:
        self.last_close = (code, reason)
        self._lost(code)
        if not again:  # closed for good: no renewal will answer the subscribe()s waiting for one
            _fail_renewals(self, OutcomeUnknown(f"connection closed ({code}): not subscribed"))
        _fire(self.on_close, "close", code, reason, again)

    def _lost(self, code: int | None) -> None:  # the connection ended: what was in flight never will be answered
        for request_id in self.session.closed():
            _settle(self._answers.pop(request_id, None), OutcomeUnknown(f"connection lost, outcome unknown ({code})"))

    async def _resubscribe(self) -> None:
        names = list(self.session.handlers)
        if self.transport == "sse":  # all at once: one stream carries them (one at a time would be one each)
            await asyncio.gather(*(_renew_one(self, name) for name in names))
            return
        for name in names:
            await _renew_one(self, name)

    async def _on_text(self, text: str | bytes) -> None:
        for event in self.session.receive(text):
            await self._handle(event)

    async def _handle(self, event: Event) -> None:
        if isinstance(event, Deliver):
            await _deliver(self.session.handlers_of(event.channel), event.params)
        elif isinstance(event, Answer):
            _settle(self._answers.pop(event.id, None), event)
        elif isinstance(event, Notify) and event.kind == "token_expiring":
            self._spawn(_refresh(self))
        elif isinstance(event, Notify):  # on_recovered, on_resync, on_presence
            if event.kind == "resync":
                logger.warning("%s: messages missed for good (%s): resync", event.channel, event.value["reason"])
            _fire(getattr(self, f"on_{event.kind}"), event.kind, event.channel, event.value)
        elif isinstance(event, Recover):
            self._spawn(_recover(self, event.channel))
        elif isinstance(event, Resubscribe):
            logger.warning("%s: a delta frame that does not apply: subscribing again", event.channel)
            for name in event.names:
                self._spawn(_subscribe_remote(self, name))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def call(
        self,
        method: str,
        params: Any = None,
        *,
        timeout: float | None = None,
        retries: int = 0,
        idempotent: bool = False,
    ) -> Any:
        """Call ``method``: its result, or :class:`RPCError` (:class:`Refused`: admission
        refused it), ``TimeoutError``, :class:`OutcomeUnknown` (the connection was lost
        before the answer: never retried silently). ``retries``: refusals sent again after
        their jittered ``retry_after_ms`` (0: the application decides). ``idempotent``
        (methods registered so): the call carries an ``"idempotency_key"`` and is sent
        again with it after a reconnect, within ``timeout``; the server runs it once."""
        each = timeout if timeout is not None else self.call_timeout  # every try its full timeout, as ever
        deadline = asyncio.get_running_loop().time() + each  # an idempotent call is sent again until then
        if idempotent:
            params = self.session.keyed(params)
        while True:
            try:
                if idempotent and self.socket.ws is None:
                    await self.wait_open(max(deadline - asyncio.get_running_loop().time(), 0.001))
                return await self._call_once(method, params, each)
            except Refused as refused:
                if retries <= 0:
                    raise
                retries -= 1
                await asyncio.sleep(retry_delay_ms(refused.retry_after_ms, random.random()) / 1000)
            except OutcomeUnknown:
                if not idempotent or self.socket.stopped or asyncio.get_running_loop().time() >= deadline:
                    raise
                logger.info("%s: connection lost before its answer, sent again with its key", method)

    async def _call_once(self, method: str, params: Any, timeout: float | None, follow: Any = None) -> Any:
        if self.socket.ws is None:
            raise ConnectionError("not connected")
        request_id, text = self.session.request(method, params, follow)
        future = self._answers[request_id] = asyncio.get_running_loop().create_future()
        try:
            await self.socket.send(text)
            return await asyncio.wait_for(future, timeout if timeout is not None else self.call_timeout)
        finally:
            self.session.forget(request_id)
            self._answers.pop(request_id, None)
            if future.done() and not future.cancelled():
                future.exception()  # settled by a lost connection while it was sent: the caller has the send's error

    async def notify(self, method: str, params: Any = None) -> None:
        """Send a notification (no answer)."""
        await self.socket.send(self.session.notification(method, params))

    async def subscribe(
        self,
        channel: str,
        handler: Handler,
        *,
        on_error: Callable[[Exception], None] | None = None,
        delta: str | None = None,
        presence: bool = False,
    ) -> dict[str, Any]:
        """Subscribe ``handler(params)`` (sync or async) to ``channel``; kept across reconnects.

        Returns the server's answer; raises :class:`RPCError` when it refuses (the handler
        is not kept). A connection lost meanwhile (1013, a refused handshake) is waited
        out: the renewal of the next connection answers. Before :meth:`connect` the
        subscription is made when the connection opens: a refusal then, or of a renewal
        after a reconnect, calls ``on_error(error)`` and every
        ``on_subscribe_error(channel, error)`` — logged only when there are none.
        ``presence``: who is in a presence channel, kept (:meth:`members`) and told (``on_presence``).
        """
        if delta is not None and delta != "fossil":
            raise ValueError(f'delta must be "fossil", got {delta!r}')
        first = self.session.book(channel, handler, on_error, delta is not None, presence)
        if not first and channel in self.session.canonical:
            return {"channel": self.session.canonical[channel]}
        if self.socket.stopped:  # not connected yet: subscribed when the connection opens
            return {"channel": channel, "pending": True}
        try:
            return await _subscribe_or_renewal(self, channel)
        except Exception:
            if first == "first":
                self.session.unbook(channel, handler)  # this call's handler: not one booked since
            raise

    def members(self, channel: str) -> dict[str, dict[str, Any]]:
        """Who is in ``channel`` (subscribed ``presence=True``): user -> ``{"user", "connections",
        "info"?}`` as of the last ``presence`` frame (none listed above the bound: RPC ``presence``)."""
        return dict(self.session.members.get(self.session.canonical.get(channel, channel), {}))

    async def unsubscribe(self, channel: str, handler: Handler | None = None) -> dict[str, Any] | None:
        """Remove ``handler`` (or all) from ``channel``; the last one out unsubscribes the
        channel the server subscribed, and returns its answer."""
        canonical = self.session.unbook(channel, handler)
        if channel not in self.session.handlers:  # a subscribe() waiting for a renewal gets none
            _fail_renewals(self, OutcomeUnknown(f"unsubscribed from {channel}"), channel)
        if canonical is not None and self.socket.ws is not None:
            with contextlib.suppress(Exception):  # the channel the server subscribed (a nearer cadence, say)
                return await self.call("unsubscribe", {"channel": canonical})  # type: ignore[no-any-return]
        return None


async def _renew_one(client: RealtimeClient, name: str) -> None:
    """A reconnect's subscribe of one booked channel; a refusal that passes is tried again when told."""
    try:
        await _subscribe_remote(client, name, renewal=True)
    except Refused as refused:  # e.g. too many resumes at once after a deploy: again when told
        if refused.reason in RENEWAL_RETRY_REASONS:
            client._spawn(_renew_later(client, name, refused))
    except Exception:  # reported by _subscribe_remote
        pass


async def _subscribe_remote(client: RealtimeClient, name: str, renewal: bool = False) -> dict[str, Any]:
    """Send ``subscribe`` for ``name`` as the session books it (with ``since`` where a
    cursor resumes); a refusal goes to the channel's and the client's error callbacks, and
    is logged when it is a renewal that nobody else hears of."""
    params, canonical, cursor = client.session.subscribe_request(name)
    timeout = max(client.call_timeout, RESUME_TIMEOUT) if "since" in params else None
    try:
        result: dict[str, Any] = await client._call_once("subscribe", params, timeout, (canonical, cursor))
    except BaseException as error:
        cursor.closed()  # no resume running: the next subscribe tries again
        if isinstance(error, RPCError) and name in client.session.handlers:
            callbacks: list[Callable[..., Any]] = [*client.session.on_error.get(name, [])]
            callbacks += [partial(f, name) for f in client.on_subscribe_error]
            if renewal and not callbacks and getattr(error, "reason", "") in RENEWAL_RETRY_REASONS:  # sent again
                logger.info("subscribe %s refused for now: %s", name, error)
            elif renewal and not callbacks:  # nobody else hears of it: the application awaited none
                logger.warning("subscribe %s refused: %s", name, error)
            _fire(callbacks, "error", error)
        if renewal and isinstance(error, RPCError) and getattr(error, "reason", "") not in RENEWAL_RETRY_REASONS:
            _answer_renewals(client, name, error)  # refused for good: the subscribe() waiting for it learns why
        raise
    client.session.subscribed(name, result)
    _fire(client.on_subscribed, "subscribed", result)
    if renewal:
        _answer_renewals(client, name, result)
    return result


async def _subscribe_or_renewal(client: RealtimeClient, channel: str) -> dict[str, Any]:
    """Send a booked channel's first ``subscribe``, or — the connection reconnecting (a 1013,
    a refused handshake, a close while it was sent) — wait for the renewal the next
    connection makes of every booked channel: its answer is this call's. Raises only when
    the server refuses, or the client is closed for good (cancel it to give up sooner)."""
    waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    client._renewals.setdefault(channel, []).append(waiter)  # before sending: a quick reconnect cannot miss it
    try:
        if client.socket.ws is not None:
            try:
                return await _subscribe_remote(client, channel)
            except (OutcomeUnknown, ConnectionError, websockets.ConnectionClosed) as lost:
                if client.socket.stopped:
                    raise
                logger.info("subscribe %s: %s; answered by the renewal once reconnected", channel, lost)
        return await waiter  # type: ignore[no-any-return]
    finally:
        waiters = client._renewals.get(channel, [])
        if waiter in waiters:
            waiters.remove(waiter)
        if not waiters:
            client._renewals.pop(channel, None)
        if waiter.done() and not waiter.cancelled():
            waiter.exception()  # answered while this call went on by the direct path: retrieved


def _answer_renewals(client: RealtimeClient, channel: str, answer: Any) -> None:
    for waiter in client._renewals.pop(channel, []):
        if not waiter.done():
            waiter.set_exception(answer) if isinstance(answer, BaseException) else waiter.set_result(answer)


def _fail_renewals(client: RealtimeClient, error: Exception, channel: str | None = None) -> None:
    for name in [channel] if channel is not None else list(client._renewals):
        _answer_renewals(client, name, error)


async def _recover(client: RealtimeClient, channel: str) -> None:
    """Subscribe again ``since`` the last message: the server replays the gap. Ends with its
    connection, or when the channel is left (a reconnect resumes anew)."""
    socket, session = client.socket, client.session
    ws, due = socket.ws, session.recover_request(channel)
    cursor = due[1] if due else None
    while due is not None and ws is not None and socket.ws is ws and due[1] is cursor:
        try:  # the replay comes first, at the pace we read
            await client._call_once("subscribe", due[0], max(client.call_timeout, RESUME_TIMEOUT), (channel, cursor))
            return
        except Refused as refused:  # try again when admission says
            await asyncio.sleep(retry_delay_ms(refused.retry_after_ms, random.random()) / 1000)
        except (RPCError, ConnectionError, TimeoutError) as error:
            logger.warning("resuming %s failed: %s", channel, error)
            await asyncio.sleep(1.0)
        due = session.recover_request(channel)


async def _renew_later(client: RealtimeClient, name: str, refused: Refused) -> None:
    """A subscription renewed after a reconnect was refused for now (``retry_after_ms``):
    sent again after that delay (jittered) while the connection and the subscription last,
    so that an avalanche of resumes does not leave clients subscribed to nothing."""
    ws = client.socket.ws
    while True:
        await asyncio.sleep(retry_delay_ms(refused.retry_after_ms, random.random()) / 1000)
        if client.socket.ws is not ws or ws is None or name not in client.session.handlers:
            return  # a new connection renews it anew; an unsubscribe ends it
        try:
            await _subscribe_remote(client, name, renewal=True)
            return
        except Refused as again:
            if again.reason not in RENEWAL_RETRY_REASONS:
                return  # reported by _subscribe_remote
            refused = again
        except Exception:  # reported by _subscribe_remote
            return


async def _refresh(client: RealtimeClient) -> None:
    """The server says the connection's token expires soon: a new one from
    ``refresh_token``, sent with RPC ``auth`` (over SSE: the header of a new stream) and
    used for the next handshakes."""
    if client.refresh_token is None:
        logger.warning("the connection token expires soon and no refresh_token was given: it will be closed (4004)")
        return
    try:
        token = client.refresh_token()
        token = await token if inspect.isawaitable(token) else token
        client.socket.headers["Authorization"] = f"Bearer {token}"
        if client.transport == "sse" and client.socket.ws is not None:
            client.socket.ws.use_headers(client.socket.headers)  # a new stream with it, then the old one goes
        else:
            await client.call("auth", {"token": token})
    except Exception as error:
        logger.warning("refreshing the connection token failed: %s", error)


async def _renew(client: RealtimeClient) -> bool:
    """Closed with 4004 (the token expired while away, say): a new one from
    ``refresh_token`` for the next handshake; False without one (the close is final)."""
    if client.refresh_token is None:
        return False
    try:
        token = client.refresh_token()
        token = await token if inspect.isawaitable(token) else token
    except Exception as error:
        logger.warning("the connection token expired and a new one could not be had: %s", error)
        return False
    client.socket.headers["Authorization"] = f"Bearer {token}"
    return True
