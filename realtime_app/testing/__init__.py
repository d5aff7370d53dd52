"""Test helpers for the methods and channels an application writes (docs/testing.md).

:class:`RealtimeTestClient` is one WebSocket connection to the endpoint, in the test's own
process and event loop — Channels' ``WebsocketCommunicator`` under it, no server, the
in-memory backplane (the fixtures see to it) — signed in as a user (``user=``), with a
connection token (``token=``), or anonymous. It calls methods and raises what the server
answers (:class:`~realtime_app.exceptions.RPCError`, ``Refused``), subscribes, and reads
the frames that arrive; :meth:`RealtimeTestClient.tick` runs a ticker's next frame now,
so a test of a cadenced channel never sleeps a period.

The pytest fixtures (``realtime_hub``, ``realtime_client``) come with the package as a
pytest plugin (``realtime_app.testing.fixtures``): install pytest-django and
pytest-asyncio, and use them.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
from typing import Any

__all__ = ["RealtimeTestClient", "tick"]


class Addresses:
    """The test clients' own addresses, numbered (a part of the process's runtime)."""

    def __init__(self) -> None:
        self.next = itertools.count(1).__next__


class RealtimeTestClient:
    """One connection to ``/realtime/`` in this process::

        async with RealtimeTestClient(user) as client:
            assert await client.call("myapp.add", {"a": 1, "b": 2}) == 3
            await client.subscribe("orders")
            ...
            message = await client.message("orders")

    ``address``: the client's address (anonymous clients of one address share their
    limits); each client gets one of its own unless told.
    """

    def __init__(self, user: Any = None, *, token: str | None = None, address: str | None = None) -> None:
        from channels.routing import URLRouter
        from channels.testing import WebsocketCommunicator
        from django.contrib.auth.models import AnonymousUser

        from realtime_app.endpoint.tokens import TokenAuthMiddleware
        from realtime_app.routing import websocket_urlpatterns

        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        app = TokenAuthMiddleware(URLRouter(websocket_urlpatterns))
        self.communicator = WebsocketCommunicator(app, "/realtime/", headers=headers)
        self.communicator.scope["user"] = user if user is not None else AnonymousUser()
        if address is None:
            from realtime_app.conf.runtime import runtime

            n = runtime().part(Addresses).next()
            address = f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
        self.communicator.scope["client"] = (address, 40000)
        self._ids = itertools.count(1)
        self._waiting: list[dict[str, Any]] = []  # notifications read while waiting for an answer
        self.closed: int | None = None  # the close code, once the server closed

    async def __aenter__(self) -> RealtimeTestClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the connection; ``AssertionError`` with the close code if the server refuses it."""
        connected, code = await self.communicator.connect()
        if not connected:
            raise AssertionError(f"the connection was refused (close code {code})")
        if self.communicator.output_queue.qsize():  # accepted, then closed at once (a refused token)
            first = await self.communicator.receive_output(1)
            if first.get("type") == "websocket.close":
                self.closed = first.get("code", 1000)
                raise AssertionError(f"the connection was closed at once (close code {self.closed})")
            self.communicator.output_queue.put_nowait(first)

    async def close(self) -> None:
        await self.communicator.disconnect()

    async def _read(self, timeout: float) -> dict[str, Any]:
        output = await self.communicator.receive_output(timeout)
        if output["type"] == "websocket.close":
            self.closed = output.get("code", 1000)
            raise ConnectionError(f"closed by the server with {self.closed}")
        message: dict[str, Any] = json.loads(output["text"])
        return message

    async def call(self, method: str, params: Any = None, *, timeout: float = 5.0) -> Any:
        """Call ``method``: its result, or the error the server answered, raised
        (:func:`~realtime_app.exceptions.error_from_response`)."""
        from realtime_app.exceptions import error_from_response

        request_id = next(self._ids)
        request: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": request_id}
        if params is not None:
            request["params"] = params
        await self.communicator.send_to(text_data=json.dumps(request))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            message = await self._read(max(deadline - loop.time(), 0.001))
            if isinstance(message, dict) and message.get("id") == request_id:
                if "error" in message:
                    raise error_from_response(message["error"])
                return message.get("result")
            self._waiting.append(message)

    async def subscribe(self, channel: str, **params: Any) -> dict[str, Any]:
        """Subscribe to ``channel`` (``presence=True``, ``since=...``, ``delta="fossil"``
        as the protocol takes them); the server's answer."""
        return await self.call("subscribe", {"channel": channel, **params})  # type: ignore[no-any-return]

    async def unsubscribe(self, channel: str) -> dict[str, Any]:
        return await self.call("unsubscribe", {"channel": channel})  # type: ignore[no-any-return]

    async def notification(self, *, timeout: float = 2.0) -> dict[str, Any]:
        """The next notification whole (``{"method", "params"}``: a ``message``, a
        ``presence``, a ``token_expiring``...), ``TimeoutError`` if none comes within
        ``timeout``; :meth:`message` is a ``message``'s params."""
        if self._waiting:
            return self._waiting.pop(0)
        return await self._read(timeout)

    async def message(self, channel: str | None = None, *, timeout: float = 2.0) -> dict[str, Any]:
        """The params of the next ``message`` (of ``channel``, skipping others)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            note = await self.notification(timeout=max(deadline - loop.time(), 0.001))
            params = note.get("params") or {}
            if note.get("method") == "message" and (channel is None or params.get("channel") == channel):
                return dict(params)

    async def nothing(self, *, within: float = 0.2) -> None:
        """Assert that no notification arrives within ``within`` seconds."""
        if self._waiting:
            raise AssertionError(f"a notification came: {self._waiting[0]}")
        if not await self.communicator.receive_nothing(within):
            raise AssertionError(f"a notification came: {await self.notification()}")

    async def tick(self, channel: str) -> int:
        """:func:`tick`: the ticker of ``channel`` publishes its next frame now."""
        return await tick(channel)


async def tick(channel: str) -> int:
    """Run the ``@ticker`` of ``channel`` (a cadence of it) once and publish what it returns,
    now — its subscribers get the frame without the test waiting a period; returns its
    ``seq``. The ticker's own schedule goes on as before."""
    from realtime_app.declarations.registry import registry
    from realtime_app.hub.hubs import get_hub

    spec = registry.resolve(channel)
    run = getattr(spec.factory, "tick", None)
    if run is None:
        raise ValueError(f"{channel!r} is not a channel of a @realtime_app.ticker: nothing to tick")
    data = run(spec)
    if inspect.isawaitable(data):
        data = await data
    hub = await get_hub()
    return await hub.publish(spec.name, data)
