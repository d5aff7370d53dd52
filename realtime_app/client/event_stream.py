"""The client's socket over HTTP: ``GET /realtime/sse`` for what the server pushes,
``POST /realtime/rpc`` for what the client asks — read and written as the frames of a
WebSocket, so that everything above it (the session, cursors and resumes, the adaptive
cadence, reconnects) is the same whichever transport carries it.

A ``subscribe`` or ``unsubscribe`` changes the stream's set of channels: a new stream is
opened with the new set (and ``Last-Event-ID``: the positions the client holds), the old
one closed once the new one answers — make before break; the stream's
``realtime.subscribed`` events answer the ``subscribe`` requests in order. Everything
else goes over HTTP RPC (with the session's CSRF token when a cookie signs it in).
:mod:`realtime_app.wire.event_stream` reads the events.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

from realtime_app.cancellation import cancel_and_wait
from realtime_app.client.http import HttpResponse, open_request
from realtime_app.wire.event_stream import EventParser, translate

__all__ = ["EventStreamSocket", "StreamRefused", "connect_event_stream", "http_base", "refusal_of"]

#: The answer of a subscribe whose channel was unsubscribed before the stream answered it.
_UNSUBSCRIBED = {"code": -32603, "message": "Unsubscribed before its answer", "data": {"reason": "unsubscribed"}}


class StreamRefused(Exception):
    """The server refused the transport itself (``status``: 401, 429, 503…); ``close_code``:
    what a socket would have been closed with, when the server says."""

    def __init__(self, status: int, reason: str, close_code: int | None = None) -> None:
        super().__init__(f"{status} {reason}")
        self.status, self.reason, self.close_code = status, reason, close_code


#: Seconds without a byte on a stream before the client takes it for dead (the server
#: writes a heartbeat every ``HEARTBEAT_SECONDS``, 20 s by default).
READ_TIMEOUT_S = 60.0
#: Seconds a change of the channel set waits for others (subscribes made together: one stream).
REOPEN_DEBOUNCE_S = 0.01
#: A stream refused by the server's own limits, as the close a socket would have had.
REFUSED_CODES = {401: 4002, 403: 1008, 429: 1013}


def error_of(body: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    """A refusal's JSON-RPC error object and its ``data`` (both empty when it has none)."""
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        error = {}
    error = error if isinstance(error, dict) else {}
    data = error.get("data")
    return error, data if isinstance(data, dict) else {}


def refusal_of(status: int, body: bytes) -> tuple[int, str]:
    """The close code and reason of a refused stream or probe (its JSON-RPC error's
    ``close_code`` and ``retry_after_ms`` when it has them)."""
    error, data = error_of(body)
    code = data.get("close_code")
    if not isinstance(code, int):
        code = REFUSED_CODES.get(status, 1013 if status >= 500 else 1006)
    reason = str(error.get("message", f"HTTP {status}"))
    retry = data.get("retry_after_ms")
    if isinstance(retry, int):
        reason += f" retry_after_ms={retry}"
    return code, reason


def http_base(url: str) -> str:
    """``ws(s)://host/realtime/`` → ``http(s)://host/realtime/`` (an http URL as it is)."""
    if url.startswith("ws"):
        url = "http" + url[2:]
    return url if url.endswith("/") else url + "/"


def _csrf(headers: dict[str, str]) -> dict[str, str]:
    """Django's CSRF header from the session's cookies (a cookie-signed RPC needs it)."""
    cookie = next((v for k, v in headers.items() if k.lower() == "cookie"), "")
    for part in cookie.split(";"):
        name, _, value = part.strip().partition("=")
        if name == "csrftoken":
            return {"X-CSRFToken": value}
    return {}


class EventStreamSocket:
    """What :class:`~realtime_app.client.reconnecting.ReconnectingSocket` reads of a
    websockets connection: ``send``, ``close``, iteration, ``close_code``."""

    def __init__(self, base: str, headers: dict[str, str], ssl_context: Any = None, on_stream: Any = None) -> None:
        self.base, self.ssl = http_base(base), ssl_context
        self.headers = {k: v for k, v in headers.items() if k.lower() != "origin"}
        self.origin = "{0.scheme}://{0.netloc}".format(urllib.parse.urlsplit(self.base))
        self.on_stream = on_stream  # called when a stream opens (the reconnect's backoff restarts)
        self.close_code: int | None = None
        self.close_reason = ""
        self._frames: asyncio.Queue[str | None] = asyncio.Queue()
        self._channels: dict[str, list[Any]] = {}  # requested name -> ids of its subscribes awaiting an answer
        self._since: dict[str, dict[str, Any]] = {}  # requested name -> the since its subscribe asked
        self._canonical: dict[str, str] = {}  # requested name -> the server's name of it
        self._served: dict[str, Any] = {}  # requested name -> the answer of the stream carrying it
        self._positions: dict[str, Any] = {}  # the stream's last id: canonical name -> [seq, epoch]
        self._reader: asyncio.Task[None] | None = None
        self._opener: asyncio.Task[None] | None = None  # the one task that (re)opens streams
        self._dirty = False  # the set of channels changed since the stream being opened
        self._tasks: set[asyncio.Task[Any]] = set()
        self.refused_stream = False  # it ended on a refused stream (the backoff goes on growing)

    # -- what the reconnecting socket uses --------------------------------------------------

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        frame = await self._frames.get()
        if frame is None:
            raise StopAsyncIteration
        return frame

    async def send(self, text: str) -> None:
        if self.close_code is not None:
            raise ConnectionError("closed")
        message = json.loads(text)
        batch = isinstance(message, list)
        remote = []
        for request in message if batch else [message]:
            method = request.get("method") if isinstance(request, dict) else None
            params = request.get("params") if isinstance(request, dict) else None
            if method == "subscribe" and isinstance(params, dict) and isinstance(params.get("channel"), str):
                self._subscribe(params, request.get("id"))
            elif method == "unsubscribe" and isinstance(params, dict) and isinstance(params.get("channel"), str):
                self._unsubscribe(params["channel"], request.get("id"))
            else:
                remote.append(request)
        if remote:
            self._spawn(self._post(remote, batch))

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self._end(code, reason)
        for task in [self._opener, self._reader, *self._tasks]:
            if task is not None and task is not asyncio.current_task():
                await cancel_and_wait(task)

    def use_headers(self, headers: dict[str, str]) -> None:
        """New headers (a refreshed token): the next requests carry them, and a new stream
        with them replaces the open one (make before break)."""
        self.headers = {k: v for k, v in headers.items() if k.lower() != "origin"}
        if self._channels:
            self._changed()

    # -- the stream's channels ---------------------------------------------------------------

    def _subscribe(self, params: dict[str, Any], request_id: Any) -> None:
        name = params["channel"]
        served = self._served.get(name)
        if served is not None and name in self._channels and not params.get("since"):
            # the stream carries it already: answered as it was, no new stream (each costs every channel)
            self._put({"jsonrpc": "2.0", "result": served, "id": request_id})
            return
        self._channels.setdefault(name, []).append(request_id)
        if isinstance(params.get("since"), dict):
            self._since[name] = params["since"]
        self._changed()

    def _unsubscribe(self, name: str, request_id: Any) -> None:
        waiting = self._channels.pop(name, None)
        self._served.pop(name, None)
        for pending in waiting or []:  # a subscribe not answered yet: it never will be
            self._put({"jsonrpc": "2.0", "error": _UNSUBSCRIBED, "id": pending})
        self._since.pop(name, None)
        self._positions.pop(self._canonical.pop(name, name), None)  # a later subscribe starts afresh
        if request_id is not None:
            self._put(
                {"jsonrpc": "2.0", "result": {"channel": name, "unsubscribed": waiting is not None}, "id": request_id}
            )
        self._changed()

    def _changed(self) -> None:
        self._dirty = True
        if self.close_code is None and (self._opener is None or self._opener.done()):
            self._opener = asyncio.get_running_loop().create_task(self._reopen())

    async def _reopen(self) -> None:
        """Open streams until one carries the current set of channels: one at a time, so
        that an older, smaller set never replaces a newer one."""
        while self._dirty and self.close_code is None:
            await asyncio.sleep(REOPEN_DEBOUNCE_S)  # subscribes made together join one stream
            self._dirty = False
            await self._open_once()

    async def _open_once(self) -> None:
        names = list(self._channels)
        if not names:
            await cancel_and_wait(self._reader)
            self._reader = None
            return
        wanted = set(names) | {self._canonical.get(name, name) for name in names}
        positions = {channel: at for channel, at in self._positions.items() if channel in wanted}
        since = {name: dict(value) for name, value in self._since.items() if name in wanted}
        for name, value in since.items():
            if "seq" in value and "epoch" in value:
                positions[self._canonical.get(name, name)] = [value["seq"], value["epoch"]]
        query = urllib.parse.urlencode([("channel", name) for name in names])
        headers = {**self.headers, "Accept": "text/event-stream"}
        if positions:
            headers["Last-Event-ID"] = json.dumps(positions, separators=(",", ":"))
        try:
            response = await open_request(f"{self.base}sse?{query}", "GET", headers, ssl_context=self.ssl)
        except Exception as error:  # unreachable, cut, garbage: the transport is gone
            return self._end(1006, f"{type(error).__name__}: {error}")
        if self.close_code is not None:  # closed while it opened: this stream is nobody's
            response.close()
            return
        if response.status != 200:
            return await self._refused(response)
        for name, value in since.items():  # asked and carried: the next stream resumes from its id
            if self._since.get(name) == value:
                del self._since[name]
        old, self._reader = self._reader, asyncio.get_running_loop().create_task(self._read(response, names))
        await cancel_and_wait(old)  # the new stream is open: the old one goes

    async def _refused(self, response: HttpResponse) -> None:
        try:
            body = await response.body()
        except Exception:
            body = b""
        finally:
            response.close()
        error, data = error_of(body)
        asked = data.get("requested", data.get("channel"))
        if asked not in self._channels:  # not named (too many channels): the newest waiting subscribe
            asked = next((name for name, ids in reversed(self._channels.items()) if ids), None)
        if response.status in (400, 403, 404) and asked in self._channels:
            for request_id in self._channels.pop(asked):
                self._put({"jsonrpc": "2.0", "error": error, "id": request_id})
            self._since.pop(asked, None)
            return self._changed()  # the others, without the refused one
        if response.status == 429 and self._reader is not None and not self._reader.done():
            # the client's pace, with a stream open: the new subscribes are refused (as a socket's
            # would be: Refused, retry_after_ms), the open stream goes on
            for name in [name for name, ids in self._channels.items() if ids]:
                for request_id in self._channels.pop(name):
                    self._put({"jsonrpc": "2.0", "error": error, "id": request_id})
                self._since.pop(name, None)
            return
        self.refused_stream = True
        self._end(*refusal_of(response.status, body))

    async def _read(self, response: HttpResponse, names: list[str]) -> None:
        parser = EventParser()
        decoder = codecs.getincrementaldecoder("utf-8")()
        answered = 0
        pieces = response.pieces().__aiter__()
        try:
            while True:
                try:  # a stream quiet past its heartbeats is a dead one (a half-open TCP connection)
                    piece = await asyncio.wait_for(pieces.__anext__(), READ_TIMEOUT_S)
                except StopAsyncIteration:
                    break
                for event in parser.feed(decoder.decode(piece)):
                    if event.id is not None and event.id != "-":
                        with contextlib.suppress(ValueError):
                            self._positions = json.loads(event.id)
                    action = translate(event)
                    if action[0] == "frame":
                        self._frames.put_nowait(action[1])
                    elif action[0] in ("answer", "refused") and answered < len(names):
                        self._answered(names[answered], action)
                        answered += 1
                        if answered == len(names) and not self._dirty and self.on_stream is not None:
                            self.on_stream()  # the whole set answered: the backoff restarts
                    elif action[0] == "close":
                        return self._end(action[1], action[2])
            self._end(1006, "stream ended")
        except Exception as error:  # cut, timed out, garbage
            self._end(1006, f"{type(error).__name__}: {error}")
        finally:
            response.close()

    def _answered(self, name: str, action: tuple[Any, ...]) -> None:
        """The stream's answer to ``name``'s subscribe: to every request waiting for it."""
        if action[0] == "answer" and isinstance(action[1], dict) and isinstance(action[1].get("channel"), str):
            self._canonical[name] = action[1]["channel"]
            self._served[name] = action[1]
        key = "result" if action[0] == "answer" else "error"
        for request_id in self._channels.get(name, []):
            self._put({"jsonrpc": "2.0", key: action[1], "id": request_id})
        if name in self._channels:
            if action[0] == "refused":
                del self._channels[name]
            else:
                self._channels[name] = []

    # -- RPC over HTTP ------------------------------------------------------------------------

    async def _post(self, requests: list[Any], batch: bool) -> None:
        body = json.dumps(requests if batch else requests[0]).encode()
        headers = {**self.headers, "Content-Type": "application/json", "Origin": self.origin, **_csrf(self.headers)}
        try:
            response = await open_request(f"{self.base}rpc", "POST", headers, body, ssl_context=self.ssl)
            try:
                text = (await response.body()).decode("utf-8")
            finally:
                response.close()
        except Exception as lost:  # unreachable, cut, garbage: the transport is gone
            return self._end(1006, f"{type(lost).__name__}: {lost}")
        if response.status == 200:
            self._frames.put_nowait(text)
        elif response.status != 204:  # refused as a whole: each request hears why
            try:
                error = json.loads(text)["error"]
            except (ValueError, KeyError, TypeError):
                error = {"code": -32603, "message": f"HTTP {response.status}", "data": {"reason": "http_error"}}
            for request in requests:
                if isinstance(request, dict) and request.get("id") is not None:
                    self._put({"jsonrpc": "2.0", "error": error, "id": request["id"]})

    # -- the end ------------------------------------------------------------------------------

    def _put(self, message: Any) -> None:
        self._frames.put_nowait(json.dumps(message, separators=(",", ":")))

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _end(self, code: int, reason: str) -> None:
        if self.close_code is None:
            self.close_code, self.close_reason = code, reason
            self._frames.put_nowait(None)


@contextlib.asynccontextmanager
async def connect_event_stream(
    base: str, headers: dict[str, str], ssl_context: Any = None, on_stream: Any = None
) -> AsyncIterator[EventStreamSocket]:
    """Open the HTTP transport: a ``ping`` notification first tells whether the server
    serves this client at all (:class:`StreamRefused` otherwise)."""
    socket = EventStreamSocket(base, headers, ssl_context, on_stream)
    ping = json.dumps({"jsonrpc": "2.0", "method": "ping"}).encode()
    probe_headers = {**socket.headers, "Content-Type": "application/json", "Origin": socket.origin}
    response = await open_request(
        f"{socket.base}rpc", "POST", {**probe_headers, **_csrf(socket.headers)}, ping, ssl_context
    )
    try:
        body = await response.body()
    finally:
        response.close()
    if response.status not in (200, 204):
        code, reason = refusal_of(response.status, body)
        raise StreamRefused(response.status, reason, code)
    try:
        yield socket
    finally:
        await socket.close()
