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

__all__ = ["EventStreamSocket", "StreamRefused", "connect_event_stream", "http_base"]


class StreamRefused(Exception):
    """The server refused the transport itself (``status``: 401, 429, 503…)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status, self.reason = status, reason


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

    def __init__(self, base: str, headers: dict[str, str], ssl_context: Any = None) -> None:
        self.base, self.ssl = http_base(base), ssl_context
        self.headers = {k: v for k, v in headers.items() if k.lower() != "origin"}
        self.origin = "{0.scheme}://{0.netloc}".format(urllib.parse.urlsplit(self.base))
        self.close_code: int | None = None
        self.close_reason = ""
        self._frames: asyncio.Queue[str | None] = asyncio.Queue()
        self._channels: dict[str, list[Any]] = {}  # requested name -> ids of its subscribes awaiting an answer
        self._since: dict[str, dict[str, Any]] = {}  # requested name -> the since its subscribe asked
        self._positions: dict[str, Any] = {}  # the stream's last id: canonical name -> [seq, epoch]
        self._reader: asyncio.Task[None] | None = None
        self._opening: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

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
        for task in [self._reader, self._opening, *self._tasks]:
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
        self._channels.setdefault(name, []).append(request_id)
        if isinstance(params.get("since"), dict):
            self._since[name] = params["since"]
        self._changed()

    def _unsubscribe(self, name: str, request_id: Any) -> None:
        was = self._channels.pop(name, None) is not None
        self._since.pop(name, None)
        if request_id is not None:
            self._put({"jsonrpc": "2.0", "result": {"channel": name, "unsubscribed": was}, "id": request_id})
        self._changed()

    def _changed(self) -> None:
        if self._opening is None or self._opening.done():
            self._opening = asyncio.get_running_loop().create_task(self._reopen())

    async def _reopen(self) -> None:
        await asyncio.sleep(0)  # the frame's other subscribes join this stream
        self._opening = None
        names = list(self._channels)
        if not names:
            await cancel_and_wait(self._reader)
            self._reader = None
            return
        positions = dict(self._positions)
        for name, since in self._since.items():
            if "seq" in since and "epoch" in since:
                positions[name] = [since["seq"], since["epoch"]]
        query = urllib.parse.urlencode([("channel", name) for name in names])
        headers = {**self.headers, "Accept": "text/event-stream"}
        if positions:
            headers["Last-Event-ID"] = json.dumps(positions, separators=(",", ":"))
        try:
            response = await open_request(f"{self.base}sse?{query}", "GET", headers, ssl_context=self.ssl)
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as error:
            return self._end(1006, f"{type(error).__name__}: {error}")
        if response.status != 200:
            return await self._refused(response)
        self._since.clear()
        old, self._reader = self._reader, asyncio.get_running_loop().create_task(self._read(response, names))
        await cancel_and_wait(old)  # the new stream is open: the old one goes

    async def _refused(self, response: HttpResponse) -> None:
        try:
            error = json.loads(await response.body()).get("error") or {}
        except (ValueError, AttributeError, OSError, asyncio.IncompleteReadError):
            error = {}
        finally:
            response.close()
        data = error.get("data") if isinstance(error, dict) else None
        channel = data.get("channel") if isinstance(data, dict) else None
        if response.status in (400, 403, 404) and channel is not None:
            waiting = [name for name, ids in self._channels.items() if ids]
            name = channel if channel in self._channels else next(iter(waiting or self._channels), None)
            for request_id in self._channels.pop(name, []) if name is not None else []:
                self._put({"jsonrpc": "2.0", "error": error, "id": request_id})
            self._since.pop(name or "", None)
            return self._changed()  # the others, without the refused one
        code = data.get("close_code") if isinstance(data, dict) else None
        if not isinstance(code, int):
            code = {401: 4002, 429: 1008}.get(response.status, 1013 if response.status >= 500 else 1006)
        self._end(code, str(error.get("message", response.status)) if isinstance(error, dict) else "")

    async def _read(self, response: HttpResponse, names: list[str]) -> None:
        parser = EventParser()
        decoder = codecs.getincrementaldecoder("utf-8")()
        answered = 0
        try:
            async for piece in response.pieces():
                for event in parser.feed(decoder.decode(piece)):
                    if event.id is not None and event.id != "-":
                        with contextlib.suppress(ValueError):
                            self._positions = json.loads(event.id)
                    action = translate(event)
                    if action[0] == "frame":
                        self._frames.put_nowait(action[1])
                    elif action[0] in ("answer", "refused") and answered < len(names):
                        key = "result" if action[0] == "answer" else "error"
                        for request_id in self._channels.get(names[answered], [])[:]:
                            self._put({"jsonrpc": "2.0", key: action[1], "id": request_id})
                        if names[answered] in self._channels:
                            self._channels[names[answered]] = []
                            if action[0] == "refused":
                                del self._channels[names[answered]]
                        answered += 1
                    elif action[0] == "close":
                        return self._end(action[1], action[2])
            self._end(1006, "stream ended")
        except (OSError, asyncio.IncompleteReadError, ValueError) as error:
            self._end(1006, f"{type(error).__name__}: {error}")
        finally:
            response.close()

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
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as lost:
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
    base: str, headers: dict[str, str], ssl_context: Any = None
) -> AsyncIterator[EventStreamSocket]:
    """Open the HTTP transport: a ``ping`` notification first tells whether the server
    serves this client at all (:class:`StreamRefused` otherwise)."""
    socket = EventStreamSocket(base, headers, ssl_context)
    ping = json.dumps({"jsonrpc": "2.0", "method": "ping"}).encode()
    probe_headers = {**socket.headers, "Content-Type": "application/json", "Origin": socket.origin}
    response = await open_request(
        f"{socket.base}rpc", "POST", {**probe_headers, **_csrf(socket.headers)}, ping, ssl_context
    )
    try:
        text = (await response.body()).decode("utf-8", "replace")
    finally:
        response.close()
    if response.status not in (200, 204):
        raise StreamRefused(response.status, text[:200])
    try:
        yield socket
    finally:
        await socket.close()
