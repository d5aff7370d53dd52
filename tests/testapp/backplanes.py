"""A custom backplane, chosen by dotted path in a test: records what the hub asks of it."""

from __future__ import annotations

import asyncio
from typing import Any

from realtime_app.cluster.memory import MemoryBackplane

CALLS: list[tuple[str, Any]] = []


class RecordingBackplane(MemoryBackplane):
    async def join(self, channels: list[str]) -> None:
        CALLS.append(("join", sorted(channels)))

    async def leave(self, channel: str) -> None:
        CALLS.append(("leave", channel))

    async def publish(self, channel: str, data_json: str, floor: int = 0, history: Any = None) -> int:
        CALLS.append(("publish", channel))
        return await super().publish(channel, data_json, floor, history)


class GatedBackplane(MemoryBackplane):
    """``leave`` waits for ``GATE`` (when set up): a backplane that is slow at the wrong time."""

    gate: asyncio.Event | None = None

    async def join(self, channels: list[str]) -> None:
        await asyncio.sleep(0.01)

    async def leave(self, channel: str) -> None:
        if GatedBackplane.gate is not None:
            await GatedBackplane.gate.wait()


class ClusteredMemoryBackplane(MemoryBackplane):
    """One process that believes it is in a cluster: leases matter; ``renew`` can fail."""

    clustered = True
    renew_fails = False

    async def renew(self, channel: str) -> bool:
        if ClusteredMemoryBackplane.renew_fails:
            raise ConnectionError("the backplane does not answer")
        return True
