"""A custom backplane, chosen by dotted path in a test: records what the hub asks of it."""

from __future__ import annotations

from typing import Any

from realtime_app.backplane_memory import MemoryBackplane

CALLS: list[tuple[str, Any]] = []


class RecordingBackplane(MemoryBackplane):
    async def join(self, channels: list[str]) -> None:
        CALLS.append(("join", sorted(channels)))

    async def leave(self, channel: str) -> None:
        CALLS.append(("leave", channel))

    async def publish(self, channel: str, data_json: str, floor: int = 0) -> int:
        CALLS.append(("publish", channel))
        return await super().publish(channel, data_json, floor)
