"""A small JSON-RPC WebSocket client for the tests, on the websockets library."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import websockets


class RPC:
    """One connection: ``call()`` answers, ``frames()`` collects ``message`` notifications."""

    def __init__(
        self,
        url: str,
        *,
        cookie: str | None = None,
        origin: str | None = None,
        ssl: Any = None,
        address: str | None = None,
        sock: Any = None,
        token: str | None = None,
    ) -> None:
        """``token``: a connection token, sent as ``Authorization: Bearer``.
        ``address``: the client's address as a trusted proxy forwards it (the test
        settings trust 127.0.0.1): a client of its own, not one of 127.0.0.1's sockets.
        ``sock``: a connected socket to use (a small receive buffer, say)."""
        self.url = url
        self.sock = sock
        self.ssl = ssl
        self.headers = {"Cookie": cookie} if cookie else {}
        if address is not None:
            self.headers["X-Forwarded-For"] = address
        if token is not None:
            self.headers["Authorization"] = f"Bearer {token}"
        host = url.split("/")[2]
        self.origin = origin or f"{'https' if url.startswith('wss') else 'http'}://{host}"
        self.ids = itertools.count(1)
        self.ws: Any = None

    async def __aenter__(self) -> RPC:
        self.ws = await websockets.connect(
            self.url,
            origin=self.origin,
            additional_headers=self.headers,
            max_size=None,
            open_timeout=10,
            **({"ssl": self.ssl} if self.ssl is not None else {}),
            **({"sock": self.sock} if self.sock is not None else {}),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()

    async def send(self, payload: Any) -> None:
        await self.ws.send(payload if isinstance(payload, str) else json.dumps(payload))

    async def recv(self, timeout: float = 5) -> Any:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def call(self, method: str, params: Any = None, timeout: float = 5) -> Any:
        request_id = next(self.ids)
        request: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": request_id}
        if params is not None:
            request["params"] = params
        await self.send(request)
        while True:
            message = await self.recv(timeout)
            if isinstance(message, dict) and message.get("id") == request_id:
                return message

    async def subscribe(self, channel: str) -> dict[str, Any]:
        answer = await self.call("subscribe", {"channel": channel})
        if "error" in answer:
            raise AssertionError(f"subscribe {channel}: {answer['error']}")
        return answer["result"]  # type: ignore[no-any-return]

    async def frames(self, n: int, timeout: float = 10) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while len(out) < n:
            message = await self.recv(timeout)
            if isinstance(message, dict) and message.get("method") == "message":
                out.append(message["params"])
        return out

    async def close_code(self, timeout: float = 30) -> int:
        """:func:`close_code` of this connection."""
        return await close_code(self.ws, timeout)


async def close_code(ws: Any, timeout: float = 30) -> int:
    """Read on (a paused transport resumed) until the server closes the socket: its close
    code, 1006 when it went without a close frame. Fails if still open after ``timeout``."""
    ws.transport.resume_reading()
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.wait_for(ws.recv(), left)
    except websockets.ConnectionClosed as closed:
        return closed.rcvd.code if closed.rcvd else 1006
    except TimeoutError:
        pass
    raise AssertionError(f"still open after {timeout} s")


async def closed_with(
    url: str, cookie: str | None = None, timeout: float = 30, token: str | None = None
) -> tuple[int, str]:
    """Open a WebSocket (signed in with ``cookie``, or a connection ``token``) and read until
    the server closes it: its close code and reason. Fails if a frame comes instead."""
    origin = "http://" + url.split("/")[2]
    headers = {"Cookie": cookie} if cookie else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with websockets.connect(url, origin=origin, additional_headers=headers) as ws:
        try:
            await asyncio.wait_for(ws.recv(), timeout)
        except websockets.ConnectionClosed as closed:
            assert closed.rcvd is not None
            return closed.rcvd.code, closed.rcvd.reason
    raise AssertionError("a frame came instead of the close")


async def call_honouring_refusals(rpc: RPC, method: str, params: Any, timeout: float = 15) -> Any:
    """Call ``method``; a refusal with ``retry_after_ms`` is sent again then, as clients do."""
    while True:
        answer = await rpc.call(method, params, timeout=timeout)
        retry = answer.get("error", {}).get("data", {}).get("retry_after_ms")
        if retry is None:
            return answer
        await asyncio.sleep(retry / 1000)
