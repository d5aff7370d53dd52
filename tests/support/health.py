"""Reading a server's probe from outside, as the staff user: ``GET /realtime/api/health``."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from tests.servers import login

__all__ = ["Probe"]


class Probe:
    """Reads the health endpoint as the staff user."""

    def __init__(self, server, scheme="http", context=None):
        self.base = f"{scheme}://127.0.0.1:{server.port}"
        self.context = context
        self.cookie = login(self.base, "admin", "admin", context)

    def read(self, part="totals"):
        request = urllib.request.Request(self.base + "/realtime/api/health", headers={"Cookie": self.cookie or ""})
        body = urllib.request.urlopen(request, context=self.context).read()
        return json.loads(body)[part]

    async def aread(self):
        return await asyncio.to_thread(self.read)
