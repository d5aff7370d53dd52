"""The pytest fixtures of ``realtime_app.testing`` (a pytest plugin the package registers):

* ``realtime_hub`` — the hub of the test's event loop on the in-memory backplane (whatever
  the settings say: no Redis in a unit test), stopped after the test with every ticker it
  started;
* ``realtime_client`` — a factory of :class:`~realtime_app.testing.RealtimeTestClient`
  (``await realtime_client(user)``), each closed after the test.

Async fixtures: pytest-asyncio runs them (``asyncio_mode = auto``, or its markers).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from asgiref.sync import sync_to_async

try:  # pytest-asyncio's fixture decorator in its strict mode as in auto; plain pytest otherwise
    from pytest_asyncio import fixture as async_fixture
except ImportError:  # pragma: no cover - without pytest-asyncio nothing runs these
    async_fixture = pytest.fixture  # type: ignore[assignment]

__all__ = ["realtime_client", "realtime_hub"]


@async_fixture
async def realtime_hub() -> AsyncIterator[Any]:
    """The started hub of this test's loop, on the in-memory backplane."""
    from django.test import override_settings

    from realtime_app.conf import get_config
    from realtime_app.hub.hubs import get_hub, hubs

    with override_settings(REALTIME_APP={**get_config(), "BACKPLANE": "memory"}):
        loop = asyncio.get_running_loop()
        hubs().by_loop.pop(loop, None)  # a hub of this loop's earlier test (a loop shared by tests) is not this one
        hub = await get_hub()
        try:
            yield hub
        finally:
            await hub.aclose()
            hubs().by_loop.pop(loop, None)
            await sync_to_async(_close_connections)()  # asgiref's one worker thread: policies, the test's ORM


def _close_connections() -> None:
    """Close this thread's database connections that no transaction holds: Channels' test
    communicators skip the closing that a request's end does, and a connection left open
    keeps PostgreSQL from dropping the test database."""
    from django.db import connections

    for connection in connections.all(initialized_only=True):
        if not connection.in_atomic_block:
            connection.close()


@async_fixture
async def realtime_client(realtime_hub: Any) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """``await realtime_client(user=None, token=None)``: an open test client."""
    from realtime_app.testing import RealtimeTestClient

    opened: list[RealtimeTestClient] = []

    async def make(user: Any = None, **kwargs: Any) -> RealtimeTestClient:
        client = RealtimeTestClient(user, **kwargs)
        await client.connect()
        opened.append(client)
        return client

    yield make
    for client in opened:  # each, whatever the others do
        with contextlib.suppress(Exception):
            await client.close()
