"""An in-process client of the endpoint (Channels' ``WebsocketCommunicator``, the
in-memory backplane): one JSON-RPC connection, its own address unless told."""

from __future__ import annotations

import itertools
import json

from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser

from realtime_app.routing import websocket_urlpatterns

__all__ = ["Client", "app"]

app = URLRouter(websocket_urlpatterns)

_addresses = itertools.count(1)


class Client:
    """One client: its own address unless ``address`` is given (anonymous clients of one
    address share an identity: one bucket, one cap)."""

    def __init__(self, user=None, address=None):
        self.comm = WebsocketCommunicator(app, "/realtime/")
        self.comm.scope["user"] = user or AnonymousUser()
        if address is None:
            n = next(_addresses)
            address = f"10.{n >> 16 & 255}.{n >> 8 & 255}.{n & 255}"
        self.comm.scope["client"] = (address, 40000)
        self.next_id = 0

    async def __aenter__(self):
        connected, _ = await self.comm.connect()
        assert connected
        return self

    async def __aexit__(self, *exc):
        await self.comm.disconnect()

    async def send(self, obj):
        await self.comm.send_to(text_data=obj if isinstance(obj, str) else json.dumps(obj))

    async def recv(self, timeout=3):
        return json.loads(await self.comm.receive_from(timeout))

    async def call_nowait(self, method, params=None):
        """Send a request and return its id; the answer is read later."""
        self.next_id += 1
        request = {"jsonrpc": "2.0", "method": method, "id": self.next_id}
        if params is not None:
            request["params"] = params
        await self.send(request)
        return self.next_id

    async def call(self, method, params=None):
        await self.call_nowait(method, params)
        while True:
            message = await self.recv()
            if message.get("id") == self.next_id:
                return message

    async def frames(self, n, channel=None, timeout=3):
        out = []
        while len(out) < n:
            message = await self.recv(timeout)
            if message.get("method") == "message" and (channel is None or message["params"]["channel"] == channel):
                out.append(message["params"])
        return out
