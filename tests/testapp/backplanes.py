"""Custom backplanes, chosen by dotted path in tests (``BACKPLANE``): one records what the
hub asks of it, the others are slow, gated or failing at the wrong time."""

from __future__ import annotations

import asyncio
from typing import Any

from realtime_app.cluster.base import Backplane
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


class GatedHistory(MemoryBackplane):
    """Reading a history waits for ``gate``: live publications arrive during the replay."""

    gate: asyncio.Event | None = None
    reading: asyncio.Event | None = None

    async def history(self, channel, policy, since=None, floor=0):
        assert GatedHistory.gate is not None and GatedHistory.reading is not None
        result = await super().history(channel, policy, since, floor)
        GatedHistory.reading.set()
        await GatedHistory.gate.wait()  # what was read is now older than what is published
        return result


class UnreadableHistory(MemoryBackplane):
    """Redis answers everything but the history read."""

    async def history(self, channel, policy, since=None, floor=0):
        raise ConnectionError("the history does not answer")


class CancelledAsCheckReturns(MemoryBackplane):
    """``check()`` arranges for the beat's task to be cancelled in the instant it returns."""

    armed = False

    async def check(self) -> bool:
        if CancelledAsCheckReturns.armed:
            task = next(t for t in asyncio.all_tasks() if t.get_name() == "realtime-maintain")
            asyncio.get_running_loop().call_soon(task.cancel)
        return True


class SlowToAnswer(MemoryBackplane):
    """``check()`` answers after ``delay`` seconds (a busy machine, not a dead Redis)."""

    delay = 0.0

    async def check(self) -> bool:
        await asyncio.sleep(SlowToAnswer.delay)
        return True


class PartialBackplane(Backplane):
    """A project's backplane that implements a broker's publishing and nothing else."""

    clustered = True

    async def start(self, deliver):  # type: ignore[no-untyped-def]
        return None

    async def publish(self, channel, data_json, floor=0, history=None):  # type: ignore[no-untyped-def]
        return 1
