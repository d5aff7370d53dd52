"""The socket under a :class:`~realtime_app.client.connection.RealtimeClient`: connect,
read, tell how it closed, wait a capped jittered backoff, again — until stopped.

It knows nothing of JSON-RPC: the client's session (:mod:`realtime_app.wire.session`)
gets every text frame through ``on_text``, and ``on_closed`` hears each end.
"""

from __future__ import annotations

import asyncio
import random
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple

import websockets
from websockets.typing import Origin

from realtime_app.cancellation import cancel_and_wait
from realtime_app.client.event_stream import StreamRefused, connect_event_stream, refusal_of

__all__ = [
    "ORIGIN_REFUSALS",
    "RECONNECT_CODES",
    "Hooks",
    "ReconnectingSocket",
    "is_reconnectable_close_code",
    "reconnect_ticket",
    "retry_after_ms",
    "with_ticket",
]

#: Close codes after which the client reconnects; 1008 and 4xxx are fatal.
RECONNECT_CODES = frozenset({1001, 1005, 1006, 1011, 1012, 1013})
#: The connection token expired (4004): with a way to get a new one, connect again with it.
TOKEN_EXPIRED = 4004
#: 403s in a row to a client never let in before it takes one as a refused origin (final):
#: daphne answers 403 too to a handshake its application did not accept in time.
ORIGIN_REFUSALS = 3


def is_reconnectable_close_code(code: int | None) -> bool:
    """True for the transient close codes (1013 included), False for 1008, 4xxx and the rest."""
    return code in RECONNECT_CODES


def retry_after_ms(reason: str) -> int | None:
    """The ``retry_after_ms=<n>`` of a close reason (a draining server's 1012), if any."""
    match = re.search(r"\bretry_after_ms=(\d{1,9})\b", reason or "")
    return int(match[1]) if match else None


def reconnect_ticket(reason: str) -> str | None:
    """The ``ticket=<t>`` of a draining server's 1012, if any: shown on the next handshake,
    it is not refused as a crowd's (:mod:`realtime_app.endpoint.tickets`)."""
    match = re.search(r"(?:^|\s)ticket=([A-Za-z0-9_:-]{1,100})(?:\s|$)", reason or "")
    return match[1] if match else None


def with_ticket(url: str, ticket: str | None) -> str:
    """``url`` with ``ticket=<ticket>`` in its query, in place of any it had (the URL as
    given without one)."""
    if not ticket:
        return url
    parts = urllib.parse.urlsplit(url)
    kept = [part for part in parts.query.split("&") if part and not part.startswith("ticket=")]
    query = "&".join([*kept, urllib.parse.urlencode({"ticket": ticket})])
    return urllib.parse.urlunsplit(parts._replace(query=query))


class Hooks(NamedTuple):
    """What the socket tells its client: its state, an opened connection (a task of its
    own), each text frame (in the reading task), each close (and whether it reconnects)."""

    on_state: Callable[[str], None]
    on_open: Callable[[], Coroutine[Any, Any, None]]
    on_text: Callable[[str | bytes], Awaitable[None]]
    on_closed: Callable[[int | None, str, bool], None]
    #: Closed with 4004 (its connection token expired): a new token in the headers and True
    #: to connect again at once, False to stay closed (no way to get one).
    on_expired: Callable[[], Awaitable[bool]] | None = None


class ReconnectingSocket:
    """One logical socket: reopened after transient closes until :meth:`stop`."""

    def __init__(
        self,
        url: str,
        origin: str | None,
        headers: dict[str, str],
        backoff: Callable[[], tuple[float, float]],
        connect_kwargs: dict[str, Any],
        hooks: Hooks,
        transport: str = "websocket",
    ) -> None:
        self.url, self.origin, self.headers = url, origin, headers
        if transport not in ("websocket", "sse"):
            raise ValueError(f'transport must be "websocket" or "sse", not {transport!r}')
        self.transport = transport  # "websocket", or "sse": Server-Sent Events and HTTP RPC
        self.backoff = backoff  # (initial, max) seconds, read at each reconnect
        self.connect_kwargs = connect_kwargs
        self._on_state, self._on_open, self._on_text, self._on_closed, self._on_expired = hooks
        self.ws: Any = None
        self.attempt = 0
        self.was_open = False  # this server let the socket in once: a 403 now is not about its origin
        self.forbidden = 0  # 403s in a row before the first open
        self.last_close: tuple[int | None, str] | None = None
        self.runner: asyncio.Task[None] | None = None
        self.opened = asyncio.Event()
        self.stopped = True
        self._blip_ms: float | None = None  # set by reconnect(): the delay before the new connection
        self._stream_refused = False  # the last SSE transport ended on a refused stream
        self._ticket: str | None = None  # a drain's reconnect ticket, shown (by a WebSocket) until one is served

    def start(self) -> None:
        self.stopped = False
        if self.runner is None or self.runner.done():
            self.forbidden = 0  # a new start: its 403s are counted afresh
            self.runner = asyncio.get_running_loop().create_task(self._run(), name="realtime-client")

    async def first_open(self, timeout: float) -> None:
        """Until the loop (started) has opened a connection; ``ConnectionRefusedError`` as
        soon as it ends for good first, ``TimeoutError`` after ``timeout``."""
        opened = asyncio.ensure_future(self.opened.wait())
        ended = self.runner
        try:
            await asyncio.wait(
                {opened} if ended is None else {opened, ended}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            opened.cancel()  # no-op once it is done
        if opened.done() and not opened.cancelled():  # it opened (it may have closed again since)
            return
        if ended is not None and ended.done():
            code, reason = self.last_close or (None, "")
            raise ConnectionRefusedError(f"closed for good ({code}): {reason}")
        raise TimeoutError(f"not open after {timeout} s (still trying)")

    async def stop(self, code: int) -> None:
        self.stopped = True
        if self.ws is not None:
            await self.ws.close(code)
        await cancel_and_wait(self.runner)

    async def reconnect(self, delay_ms: float) -> None:
        if self.ws is not None:
            self._blip_ms = delay_ms
            await self.ws.close(3000, "reconnect")

    async def send(self, text: str) -> None:
        if self.ws is None:
            raise ConnectionError("not connected")
        await self.ws.send(text)

    async def _run(self) -> None:
        while not self.stopped:
            self._on_state("reconnecting" if self.attempt else "connecting")
            code, reason = await self._session()
            self.last_close = (code, reason)
            blip, self._blip_ms = self._blip_ms, None
            if code == TOKEN_EXPIRED and self._on_expired is not None and not self.stopped:
                blip = 0 if await self._on_expired() else blip  # a new token: at once
            again = not self.stopped and (is_reconnectable_close_code(code) or blip is not None)
            self._on_closed(code, reason, again)
            if not again:
                self.stopped = True
                self._on_state("closed")
                return
            initial, ceiling = self.backoff()
            cap = min(ceiling, initial * 2**self.attempt)
            self.attempt += 1
            self._on_state("reconnecting")
            told = retry_after_ms(reason)  # a draining server says when (its own share of the reconnections)
            self._ticket = reconnect_ticket(reason) or self._ticket
            backoff = cap / 2 + random.random() * cap / 2
            if blip is None and told is not None:
                # a refused stream's bucket said when; the next stream may carry more: the backoff too
                blip = told if self.transport != "sse" else max(told, backoff * 1000)
            await asyncio.sleep(blip / 1000 if blip is not None else backoff)

    def _connect(self) -> Any:
        """The connection's context: a WebSocket, or the SSE transport."""
        if self.transport == "sse":  # its backoff restarts when a stream opens, not at the probe
            return connect_event_stream(self.url, self.headers, self.connect_kwargs.get("ssl"), self._streaming)
        return websockets.connect(
            with_ticket(self.url, self._ticket),
            origin=Origin(self.origin) if self.origin else None,
            additional_headers=self.headers,
            max_size=None,
            **self.connect_kwargs,
        )

    def _streaming(self) -> None:
        self.attempt = 0
        self._stream_refused = False

    async def _session(self) -> tuple[int | None, str]:
        """One connection, from the handshake to its close: how it closed."""
        forbidden, self.forbidden = self.forbidden, 0  # 403s in a row: any other end starts again
        try:
            async with self._connect() as ws:
                self.ws = ws
                self.was_open = True
                if not self._stream_refused:  # over SSE a refused stream restarts the backoff only once one opens
                    self.attempt = 0
                self.opened.set()
                self._on_state("open")
                opening = asyncio.get_running_loop().create_task(self._on_open())
                try:
                    async for text in ws:
                        self._ticket = None  # served (a refusal closes before any frame): spent
                        await self._on_text(text)
                finally:
                    opening.cancel()
                    self._stream_refused = bool(getattr(ws, "refused_stream", False))
                return ws.close_code or 1006, ws.close_reason or ""
        except websockets.ConnectionClosed as closed:
            return (closed.rcvd.code, closed.rcvd.reason) if closed.rcvd else (1006, "")
        except websockets.InvalidStatus as refused:  # an HTTP answer instead of the upgrade
            # The rule of every refused HTTP request of both clients: 429 and any 5xx (the
            # server's 1013 before the accept, a proxy's 502/504 mid-deploy) come back later;
            # 401 is a refused token, 403 a refused origin (fatal) — unless this socket was
            # let in before, or it is the first or second in a row: daphne answers 403 to a
            # handshake its application did not accept in time (``--websocket_connect_timeout``,
            # a crowd of handshakes: 14 of 4,500 new clients stopped for good on one): again.
            # (Over SSE a 403 is final at once: no server answers an HTTP request so for a timeout.)
            status = refused.response.status_code
            code, _ = refusal_of(status, bytes(refused.response.body or b""))
            if status == 403:
                self.forbidden = forbidden + 1
            if status == 403 and (self.was_open or self.forbidden < ORIGIN_REFUSALS):
                code = 1006
            return code, f"handshake refused ({status})"
        except StreamRefused as refused:  # the HTTP transport's door: the close a socket would have had
            return refused.close_code or 1006, f"refused ({refused.status}): {refused.reason}"
        except (
            websockets.InvalidHandshake,
            OSError,
            EOFError,
            asyncio.IncompleteReadError,
        ) as error:  # unreachable, or cut: again
            return 1006, f"{type(error).__name__}: {error}"
        finally:
            self.ws = None
            self.opened.clear()
