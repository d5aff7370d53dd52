"""Reading a server's probe from outside, as the staff user: ``GET /realtime/api/health``
(and ``/realtime/metrics``), the one reader every test uses."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

from tests.support.servers import login
from tests.support.waiting import eventually

__all__ = ["Probe"]


class Probe:
    """Reads the health endpoint as the staff user (logged in once)."""

    def __init__(self, server, scheme="http", context=None):
        self.base = f"{scheme}://127.0.0.1:{server.port}"
        self.context = context
        self.cookie = login(self.base, "admin", "admin", context)

    def _get(self, path: str) -> tuple[int, bytes]:
        request = urllib.request.Request(self.base + path, headers={"Cookie": self.cookie or ""})
        try:
            with urllib.request.urlopen(request, context=self.context, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def document(self) -> dict[str, Any]:
        """The whole answer: ``totals``, ``instances``, ``http_pools``, ``complete``, …"""
        status, body = self._get("/realtime/api/health")
        assert status == 200, (status, body[:500])
        return json.loads(body)  # type: ignore[no-any-return]

    def read(self, part="totals"):
        return self.document()[part]

    def instances(self) -> list[dict[str, Any]]:
        return self.read("instances")  # type: ignore[no-any-return]

    def instance(self) -> dict[str, Any]:
        """The probe of the only process (fails when there are several)."""
        [instance] = self.instances()
        return instance

    def admission(self) -> dict[str, Any]:
        return self.instance()["admission"]  # type: ignore[no-any-return]

    def pool(self, name: str = "test") -> dict[str, Any]:
        """One HTTP concurrency pool's figures."""
        return self.read("http_pools")[name]  # type: ignore[no-any-return]

    def metrics(self) -> tuple[int, str]:
        """``GET /realtime/metrics``: its status and text."""
        status, body = self._get("/realtime/metrics")
        return status, body.decode()

    async def aread(self, part="totals"):
        return await asyncio.to_thread(self.read, part)

    async def until(self, predicate, timeout=15.0, what="the probe's condition", seen=None):
        """Read until ``predicate(totals)`` holds and return those totals; ``seen`` (a list)
        collects every read on the way, for bounds that must hold throughout."""

        async def check():
            totals = await self.aread()
            if seen is not None:
                seen.append(totals)
            return totals if predicate(totals) else None

        return await eventually(check, timeout, what)
