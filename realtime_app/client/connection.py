"""An asyncio client of the realtime endpoint, the twin of the browser module.

Same features as ``RealtimeClient`` in ``realtime.js``: JSON-RPC calls with timeouts,
subscriptions with handlers kept across reconnects (resumed where a channel keeps a
history), capped jittered exponential backoff on transient close codes. Built on the
``websockets`` library. The adaptive cadence is :mod:`.adaptive_channel`, the operators'
CLI :mod:`.cli`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import websockets
from websockets.typing import Origin

from realtime_app.cancellation import cancel_and_wait
from realtime_app.client.cursor import Action, EventCursor
from realtime_app.client.deltas import DeltaBases, DeltaError
from realtime_app.exceptions import Refused, RPCError, error_from_response
from realtime_app.wire.retry import retry_delay_ms

__all__ = ["RECONNECT_CODES", "Handler", "RealtimeClient", "Refused", "is_reconnectable_close_code"]

logger = logging.getLogger("realtime_app.client")

#: Seconds a resume (``subscribe`` with ``since``) may take: its replay comes first, as
#: fast as this client reads it.
RESUME_TIMEOUT = 60.0

#: Close codes after which the client reconnects; 1008 and 4xxx are fatal.
RECONNECT_CODES = frozenset({1001, 1005, 1006, 1011, 1012, 1013})

Handler = Callable[[dict[str, Any]], Awaitable[None] | None]


def is_reconnectable_close_code(code: int | None) -> bool:
    """True for the transient close codes (1013 included), False for 1008, 4xxx and the rest."""
    return code in RECONNECT_CODES


def now_ms() -> float:
    return time.monotonic() * 1000


class RealtimeClient:
    """One logical connection that reconnects by itself until :meth:`close`.

    Handlers run in the reading task, one frame at a time: a slow handler slows the
    reading down, as a slow browser tab would (and the server's backpressure sees it).

    Args:
        url: ``ws://host/realtime/`` or ``wss://…``.
        origin: the Origin header (default: the URL's host over http/https).
        headers: extra handshake headers (``{"Cookie": "sessionid=…"}``).
        call_timeout: seconds before a call fails with ``TimeoutError``.
        backoff_initial, backoff_max: reconnect delays in seconds (capped, jittered).
        connect_kwargs: passed to ``websockets.connect`` (``ssl``, ``sock``, …).
    """

    def __init__(
        self,
        url: str,
        *,
        origin: str | None = None,
        headers: dict[str, str] | None = None,
        call_timeout: float = 10.0,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        **connect_kwargs: Any,
    ) -> None:
        self.url = url
        host = url.split("/")[2]
        self.origin = origin or f"{'https' if url.startswith('wss') else 'http'}://{host}"
        self.headers = headers or {}
        self.call_timeout = call_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.connect_kwargs = connect_kwargs
        self.state = "closed"
        self.attempt = 0
        self.last_close: tuple[int | None, str] | None = None
        self.on_state: list[Callable[[str], None]] = []
        self.on_close: list[Callable[[int | None, str, bool], None]] = []
        self._ws: Any = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._handlers: dict[str, list[Handler]] = {}
        self._canonical: dict[str, str] = {}
        self._on_error: dict[str, list[Callable[[Exception], None]]] = {}
        #: Called with ``(channel, error)`` for every refused subscribe, renewals included.
        self.on_subscribe_error: list[Callable[[str, Exception], None]] = []
        #: Channels with history (docs/recovery.md): ``on_resync(channel, {"epoch", "seq",
        #: "reason"})`` when messages were missed for good (reload the state);
        #: ``on_recovered(channel, replayed)`` when a resume filled a gap.
        self.on_resync: list[Callable[[str, dict[str, Any]], None]] = []
        self.on_recovered: list[Callable[[str, int], None]] = []
        #: Called with the server's answer of every accepted subscribe, renewals included.
        self.on_subscribed: list[Callable[[dict[str, Any]], None]] = []
        self._cursors: dict[str, EventCursor] = {}  # canonical channel -> place in its history
        self._on_answer: dict[int, Callable[[Any], Awaitable[None]]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._runner: asyncio.Task[None] | None = None
        self._open = asyncio.Event()
        self._stopped = True
        self._blip_ms: float | None = None  # set by reconnect(): the delay before the new connection
        self._delta_wanted: set[str] = set()  # requested names subscribed with deltas
        self._deltas = DeltaBases()  # canonical channels with deltas granted, and their bases

    # -- lifecycle -------------------------------------------------------------------

    async def __aenter__(self) -> RealtimeClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _set_state(self, state: str) -> None:
        if state == self.state == "closed":  # a close after the server's is no news
            return
        self.state = state
        for callback in self.on_state:
            callback(state)

    async def connect(self, timeout: float = 10.0) -> None:
        """Start the connection loop and wait until the first connection is open."""
        self._stopped = False
        if self._runner is None or self._runner.done():
            self._runner = asyncio.get_running_loop().create_task(self._run(), name="realtime-client")
        await asyncio.wait_for(self._open.wait(), timeout)

    async def close(self, code: int = 1000) -> None:
        """Close for good (with ``code``): no reconnect."""
        self._stopped = True
        for task in list(self._background):
            task.cancel()
        if self._ws is not None:
            await self._ws.close(code)
        await cancel_and_wait(self._runner)
        self._set_state("closed")

    async def reconnect(self, delay_ms: float = 0) -> None:
        """Drop the connection now and open a new one after ``delay_ms``, as after a network
        blip (demos and tests): subscriptions are renewed, channels with history resume."""
        if self._ws is None:
            return
        self._blip_ms = delay_ms
        await self._ws.close(3000, "reconnect")

    async def wait_open(self, timeout: float = 30.0) -> None:
        await asyncio.wait_for(self._open.wait(), timeout)

    async def _run(self) -> None:
        while not self._stopped:
            self._set_state("reconnecting" if self.attempt else "connecting")
            code: int | None = 1006
            reason = ""
            try:
                async with websockets.connect(
                    self.url,
                    origin=Origin(self.origin) if self.origin else None,
                    additional_headers=self.headers,
                    max_size=None,
                    **self.connect_kwargs,
                ) as ws:
                    self._ws = ws
                    self.attempt = 0
                    self._open.set()
                    self._set_state("open")
                    resubscribe = asyncio.get_running_loop().create_task(self._resubscribe())
                    try:
                        async for text in ws:
                            await self._on_message(text)
                    finally:
                        resubscribe.cancel()
                    code, reason = ws.close_code or 1006, ws.close_reason or ""
            except websockets.ConnectionClosed as closed:
                code, reason = (closed.rcvd.code, closed.rcvd.reason) if closed.rcvd else (1006, "")
            except websockets.InvalidStatus as refused:  # 503 / 429: the server's 1013, before the accept
                status = refused.response.status_code
                code, reason = (1013 if status in (429, 503) else 4000 + status), f"handshake refused ({status})"
            except (websockets.InvalidHandshake, OSError, EOFError) as error:  # unreachable, or cut: again
                code, reason = 1006, f"{type(error).__name__}: {error}"
            finally:
                self._ws = None
                self._open.clear()
                self._on_answer.clear()
                for cursor in self._cursors.values():
                    cursor.closed()
                self._deltas.reset()  # a new connection starts with full frames
                for future in self._pending.values():
                    if not future.done():
                        future.set_exception(ConnectionError(f"connection closed ({code})"))
                self._pending.clear()
            self.last_close = (code, reason)
            blip, self._blip_ms = self._blip_ms, None
            again = not self._stopped and (is_reconnectable_close_code(code) or blip is not None)
            for callback in self.on_close:
                callback(code, reason, again)
            if not again:
                self._stopped = True
                self._set_state("closed")
                return
            cap = min(self.backoff_max, self.backoff_initial * 2**self.attempt)
            self.attempt += 1
            self._set_state("reconnecting")
            await asyncio.sleep(blip / 1000 if blip is not None else cap / 2 + random.random() * cap / 2)

    async def _resubscribe(self) -> None:
        for name in list(self._handlers):
            with contextlib.suppress(Exception):  # reported by _subscribe_remote
                await self._subscribe_remote(name, renewal=True)

    # -- messages --------------------------------------------------------------------

    async def _on_message(self, text: str | bytes) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            return
        for item in message if isinstance(message, list) else [message]:
            if not isinstance(item, dict):
                continue
            if item.get("method") == "message" and isinstance(item.get("params"), dict):
                await self._deliver(item["params"])
            elif item.get("id") in self._pending:
                future = self._pending.pop(item["id"])
                on_answer = self._on_answer.pop(item["id"], None)
                if future.done():
                    continue
                if on_answer is not None and "result" in item:
                    await on_answer(item["result"])  # in order with the messages around it
                if "error" in item:
                    error = item["error"]
                    future.set_exception(error_from_response(error if isinstance(error, dict) else {}))
                else:
                    future.set_result(item.get("result"))

    async def _deliver(self, params: dict[str, Any]) -> None:
        channel = params.get("channel")
        if "delta" in params and isinstance(channel, str):  # only delta subscriptions carry it
            if channel not in self._deltas:  # its first frame, before the subscribe's answer?
                if channel not in self._delta_wanted and channel not in self._canonical.values():
                    return  # still in flight after an unsubscribe
                self._deltas.granted(channel)
            try:
                params = self._deltas.rebuild(channel, params)
            except DeltaError as exc:  # never applied to another base: a full frame instead
                if self._deltas.resync(channel):
                    logger.warning("%s: a delta frame that does not apply (%s): subscribing again", channel, exc)
                    names = [n for n, c in self._canonical.items() if c == channel] or [channel]
                    for name in names:
                        self._spawn(self._subscribe_remote(name))
                return
        if "epoch" in params and isinstance(channel, str):  # a channel with history: in order, once
            cursor = self._cursors.get(channel)
            if cursor is not None:  # else a frame still in flight after unsubscribe
                await self._act(channel, cursor.message(params))
            return
        await self._hand_over(channel, params)

    async def _act(self, channel: str, actions: list[Action]) -> None:
        for kind, value in actions:
            if kind == "deliver":
                await self._hand_over(channel, value)
            elif kind == "recover":
                self._spawn(self._recover(channel))
            else:
                callbacks: list[Any] = self.on_recovered if kind == "recovered" else self.on_resync
                if kind == "resync":
                    logger.warning("%s: messages missed for good (%s): resync", channel, value["reason"])
                for callback in list(callbacks):
                    try:
                        callback(channel, value)
                    except Exception:
                        logger.exception("%s callback of %s failed", kind, channel)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _recover(self, channel: str) -> None:
        """Subscribe again ``since`` the last message: the server replays the gap. Ends
        with its connection, or when the channel is left (a reconnect resumes anew)."""
        cursor = self._cursors.get(channel)
        ws = self._ws
        while cursor is not None and cursor.recovering and ws is not None:
            if self._ws is not ws or self._cursors.get(channel) is not cursor:
                return
            try:
                params: dict[str, Any] = {"channel": channel, "since": cursor.since()}
                if channel in self._deltas:
                    params["delta"] = "fossil"  # the replay comes whole; deltas go on after it
                await self._call_once(
                    "subscribe",
                    params,
                    max(self.call_timeout, RESUME_TIMEOUT),  # the replay comes first, at the pace we read
                    self._answered(channel, cursor),
                )
                return
            except Refused as refused:  # try again when admission says
                await asyncio.sleep(retry_delay_ms(refused.retry_after_ms, random.random()) / 1000)
            except (RPCError, ConnectionError, TimeoutError) as error:
                logger.warning("resuming %s failed: %s", channel, error)
                await asyncio.sleep(1.0)

    def _answered(self, channel: str, cursor: EventCursor) -> Callable[[Any], Awaitable[None]]:
        """The hook that applies a subscribe's answer to the channel's cursor, in order —
        unless the channel was left (and maybe subscribed again) since it was sent."""

        async def apply(result: Any) -> None:
            if isinstance(result, dict) and result.get("delta") == "fossil":
                self._deltas.granted(result["channel"])  # in order with the frames around it
            if not isinstance(result, dict) or self._cursors.get(channel) is not cursor:
                return
            if "epoch" in result:
                await self._act(channel, cursor.answer(result))
                return
            del self._cursors[channel]  # the channel keeps no history (any more)
            if cursor.epoch is not None and result.get("recovered") is False:
                info = {"epoch": cursor.epoch, "seq": cursor.seq, "reason": result.get("reason", "no_history")}
                await self._act(channel, [("resync", info)])

        return apply

    async def _hand_over(self, channel: Any, params: dict[str, Any]) -> None:
        for name, handlers in list(self._handlers.items()):
            if self._canonical.get(name, name) == channel:
                for handler in list(handlers):
                    try:
                        result = handler(params)
                        if inspect.isawaitable(result):
                            await result
                    except Exception:
                        logger.exception("handler of %s failed", name)

    async def call(self, method: str, params: Any = None, *, timeout: float | None = None, retries: int = 0) -> Any:
        """Call ``method``; returns its result, raises :class:`RPCError` (:class:`Refused`
        when admission refused it) or ``TimeoutError``.

        ``retries``: how many times a refused call is sent again after its
        ``retry_after_ms`` (jittered by :func:`~realtime_app.wire.retry.retry_delay_ms`);
        0 by default — whether a late retry still makes sense is the application's call.
        """
        while True:
            try:
                return await self._call_once(method, params, timeout)
            except Refused as refused:
                if retries <= 0:
                    raise
                retries -= 1
                await asyncio.sleep(retry_delay_ms(refused.retry_after_ms, random.random()) / 1000)

    async def _call_once(
        self,
        method: str,
        params: Any,
        timeout: float | None,
        on_answer: Callable[[Any], Awaitable[None]] | None = None,
    ) -> Any:
        if self._ws is None:
            raise ConnectionError("not connected")
        request_id = next(self._ids)
        if on_answer is not None:
            self._on_answer[request_id] = on_answer
        request: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": request_id}
        if params is not None:
            request["params"] = params
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self._ws.send(json.dumps(request))
            return await asyncio.wait_for(future, timeout if timeout is not None else self.call_timeout)
        finally:
            self._pending.pop(request_id, None)
            self._on_answer.pop(request_id, None)

    async def notify(self, method: str, params: Any = None) -> None:
        """Send a notification (no answer)."""
        if self._ws is None:
            raise ConnectionError("not connected")
        request: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            request["params"] = params
        await self._ws.send(json.dumps(request))

    async def _subscribe_remote(self, name: str, renewal: bool = False) -> dict[str, Any]:
        canonical = self._canonical.get(name, name)
        params: dict[str, Any] = {"channel": name}
        if name in self._delta_wanted or canonical in self._deltas:
            params["delta"] = "fossil"
        cursor = self._cursors.get(canonical)
        if cursor is None:  # dropped again by the answer unless the channel keeps a history
            cursor = self._cursors[canonical] = EventCursor()
        since = cursor.since()
        if since is not None:
            params["since"] = since  # a resume: the server replays what was missed
        cursor.resuming()  # what arrives before the answer waits for the position it gives
        timeout = max(self.call_timeout, RESUME_TIMEOUT) if since is not None else None
        try:
            try:
                answered = self._answered(canonical, cursor)
                result: dict[str, Any] = await self._call_once("subscribe", params, timeout, answered)
            except BaseException:
                if cursor is not None:
                    cursor.closed()  # no resume running: the next subscribe tries again
                raise
        except RPCError as error:
            if name in self._handlers:
                callbacks: list[Callable[[Exception], None]] = list(self._on_error.get(name, []))
                callbacks += [partial(f, name) for f in self.on_subscribe_error]
                if renewal and not callbacks:  # nobody else hears of it: the application awaited none
                    logger.warning("subscribe %s refused: %s", name, error)
                for callback in callbacks:
                    try:
                        callback(error)
                    except Exception:
                        logger.exception("error callback of %s failed", name)
            raise
        self._canonical[name] = result["channel"]
        for subscribed in list(self.on_subscribed):
            try:
                subscribed(result)
            except Exception:
                logger.exception("subscribed callback of %s failed", name)
        return result

    async def subscribe(
        self,
        channel: str,
        handler: Handler,
        *,
        on_error: Callable[[Exception], None] | None = None,
        delta: str | None = None,
    ) -> dict[str, Any]:
        """Subscribe ``handler(params)`` (sync or async) to ``channel``; kept across reconnects.

        Returns the server's answer; raises :class:`RPCError` when it refuses (the handler
        is not kept). Before :meth:`connect` the subscription is made when the connection
        opens: a refusal then, or of a renewal after a reconnect, calls ``on_error(error)``
        and every ``on_subscribe_error(channel, error)`` — logged only when there are none.
        """
        first = channel not in self._handlers
        if delta is not None:
            if delta != "fossil":
                raise ValueError(f'delta must be "fossil", got {delta!r}')
            self._delta_wanted.add(channel)
        self._handlers.setdefault(channel, []).append(handler)
        if on_error is not None:
            self._on_error.setdefault(channel, []).append(on_error)
        if not first and channel in self._canonical:
            return {"channel": self._canonical[channel]}
        if self._stopped:  # not connected yet: subscribed when the connection opens
            return {"channel": channel, "pending": True}
        if self._ws is None:
            await self.wait_open(self.call_timeout)
        try:
            return await self._subscribe_remote(channel)
        except Exception:
            if first:
                self._handlers.pop(channel, None)
                self._on_error.pop(channel, None)
            raise

    async def unsubscribe(self, channel: str, handler: Handler | None = None) -> dict[str, Any] | None:
        """Remove ``handler`` (or all) from ``channel``; the last one out unsubscribes the
        channel the server subscribed, and returns its answer."""
        handlers = self._handlers.get(channel)
        if handlers is None:
            return None
        if handler is not None and handler in handlers:
            handlers.remove(handler)
        elif handler is None:
            handlers.clear()
        if handlers:
            return None
        del self._handlers[channel]
        self._on_error.pop(channel, None)
        self._delta_wanted.discard(channel)
        canonical = self._canonical.pop(channel, channel)
        if canonical not in self._canonical.values():
            self._deltas.forget(canonical)
        if canonical not in self._canonical.values():
            self._cursors.pop(canonical, None)
        if canonical not in self._canonical.values() and self._ws is not None:
            with contextlib.suppress(Exception):  # the channel the server subscribed (a nearer cadence, say)
                return await self.call("unsubscribe", {"channel": canonical})  # type: ignore[no-any-return]
        return None
