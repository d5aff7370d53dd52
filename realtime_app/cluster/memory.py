"""The embedded backplane: one process, nothing to elect, frames handed straight back.

Used with the in-memory channel layer (or none). Sequence numbers live in this process;
there is no lease to compete for and no other process to tell.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from realtime_app.cluster.base import PRESENCE_KEEP_MS, Backplane, Deliver, Delivery, now_ms
from realtime_app.observability.schema import ProcessProbe
from realtime_app.wire.history import PAGE, PAGE_BYTES, HistoryEntry, HistoryPolicy, HistoryRead, Since, new_epoch
from realtime_app.wire.protocol import notification_text

__all__ = ["MemoryBackplane", "MemoryHistory", "MemoryPresence"]


class MemoryBackplane(Backplane):
    """One process: every method answers at once and never fails."""

    def __init__(self, *, instance_id: str = "headless", config: dict[str, Any] | None = None) -> None:
        super().__init__(instance_id=instance_id, config=config)
        self._deliver: Deliver | None = None
        self._seq: dict[str, int] = {}
        self._probe: ProcessProbe | None = None
        self._history = MemoryHistory()
        self._published_once: dict[tuple[str, str], float] = {}  # outbox rows published, oldest first
        self._presence = MemoryPresence()

    async def start(self, deliver: Deliver) -> None:
        self._deliver = deliver

    async def stop(self) -> None:
        self._deliver = None

    async def check(self) -> bool:
        return True

    async def join(self, channels: list[str]) -> None:
        pass

    async def leave(self, channel: str) -> None:
        pass

    async def publish(self, channel: str, data_json: str, floor: int = 0, history: HistoryPolicy | None = None) -> int:
        seq = max(self._seq.get(channel, 0), floor) + 1
        self._seq[channel] = seq
        ts = now_ms()
        epoch = ""
        if history is None:
            text = notification_text(channel, data_json, seq, ts)
        else:
            epoch = self._history.epoch(channel, history)
            text = notification_text(channel, data_json, seq, ts, epoch)
            self._history.append(channel, history, HistoryEntry(seq, ts, text))
            self.histories[channel] = (epoch, self._history.size(channel))
        if self._deliver is not None:
            await self._deliver(Delivery("frame", channel, text, seq, epoch))
        return seq

    async def publish_once(
        self, channel: str, data_json: str, floor: int, history: HistoryPolicy, key: str, window_ms: int
    ) -> int | None:
        now = time.monotonic()
        done = self._published_once
        while done and next(iter(done.values())) < now - window_ms / 1000:  # oldest first: out of the window
            done.pop(next(iter(done)))
        if (channel, key) in done:
            return None
        seq = await self.publish(channel, data_json, floor, history)
        done[(channel, key)] = now  # only once it went out
        return seq

    async def history(
        self, channel: str, policy: HistoryPolicy, since: Since | None = None, floor: int = 0
    ) -> HistoryRead:
        top = self._seq[channel] = max(self._seq.get(channel, 0), floor)
        read = self._history.read(channel, policy, top, since, now_ms(), PAGE)
        self.histories[channel] = (read.epoch, read.size)
        return read

    async def history_page(
        self, channel: str, after: int, count: int, max_bytes: int = PAGE_BYTES
    ) -> list[HistoryEntry]:
        return self._history.page(channel, after, count, max_bytes)

    async def reseed(self, floors: dict[str, int]) -> None:
        for channel, floor in floors.items():
            self._seq[channel] = max(self._seq.get(channel, 0), floor)

    async def acquire(self, channel: str) -> bool:
        return True

    async def renew(self, channel: str) -> bool:
        return True

    async def release(self, channel: str) -> None:
        pass

    async def put_probe(self, probe: ProcessProbe, ttl_ms: int) -> None:
        self._probe = probe

    async def drop_probe(self) -> None:
        self._probe = None

    async def cluster_probes(self) -> list[ProcessProbe]:
        return [self._probe] if self._probe else []

    async def put_presence(self, parts: dict[str, str | None], ttl_ms: int, alive: bool = False) -> None:
        self._presence.put(self.instance_id, parts, now_ms() + ttl_ms)

    async def presence_alive(self, ttl_ms: int) -> tuple[int, bool] | None:
        """One process: nothing of it dies unseen, its parts need no renewal but a rare one."""
        return PRESENCE_KEEP_MS, True

    async def read_presence(self, known: dict[str, str]) -> dict[str, tuple[str, list[str]] | None]:
        return self._presence.read(known, now_ms())


class MemoryPresence:
    """Presence parts by channel and process, each until its lease ends; a version per
    channel that changes when what a reader would see does."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[str, tuple[int, str]]] = {}  # channel -> process -> (until ms, part)
        self._versions: dict[str, int] = {}
        self._next = 0

    def _changed(self, channel: str) -> None:
        self._next += 1
        self._versions[channel] = self._next

    def put(self, owner: str, parts: dict[str, str | None], until: int) -> None:
        for channel, part in parts.items():
            kept = self._parts.setdefault(channel, {})
            held = kept.get(owner)
            if part is None:
                if kept.pop(owner, None) is not None:
                    self._changed(channel)
            else:
                kept[owner] = (until, part)
                if held is None or held[1] != part:
                    self._changed(channel)
            if not kept:
                del self._parts[channel]
                self._versions.pop(channel, None)  # a later one is above it: ``_next`` only grows

    def read(self, known: dict[str, str], now: int) -> dict[str, tuple[str, list[str]] | None]:
        out: dict[str, tuple[str, list[str]] | None] = {}
        for channel, version in known.items():
            kept = self._parts.get(channel, {})
            for owner in [o for o, (until, _) in kept.items() if until <= now]:
                del kept[owner]
                self._changed(channel)
            if not kept:
                self._parts.pop(channel, None)
                self._versions.pop(channel, None)
            current = str(self._versions.get(channel, 0))
            out[channel] = None if current == version else (current, [part for _, part in kept.values()])
        return out


class _Log:
    __slots__ = ("entries", "epoch")

    def __init__(self, size: int) -> None:
        self.epoch = new_epoch()
        self.entries: deque[HistoryEntry] = deque(maxlen=size)


class MemoryHistory:
    """The histories of one process (the embedded backplane): a bounded deque per channel
    under an epoch drawn when the process first needs it."""

    def __init__(self) -> None:
        self._logs: dict[str, _Log] = {}

    def _log(self, channel: str, policy: HistoryPolicy) -> _Log:
        log = self._logs.get(channel)
        if log is None or log.entries.maxlen != policy.size:
            log = self._logs[channel] = _Log(policy.size)
        return log

    def epoch(self, channel: str, policy: HistoryPolicy) -> str:
        return self._log(channel, policy).epoch

    def append(self, channel: str, policy: HistoryPolicy, entry: HistoryEntry) -> None:
        self._log(channel, policy).entries.append(entry)

    def size(self, channel: str) -> int:
        log = self._logs.get(channel)
        return len(log.entries) if log is not None else 0

    def read(
        self,
        channel: str,
        policy: HistoryPolicy,
        top: int,
        since: Since | None,
        now_ms: int,
        count: int,
        max_bytes: int = PAGE_BYTES,
    ) -> HistoryRead:
        log = self._log(channel, policy)
        oldest = now_ms - policy.ttl_ms
        while log.entries and log.entries[0].ts < oldest:  # expired: gone, as in Redis
            log.entries.popleft()
        entries: list[HistoryEntry] = []
        if since is not None and since.epoch == log.epoch and 0 < top - since.seq <= policy.size:
            entries = self.page(channel, since.seq, count, max_bytes)
        return HistoryRead(log.epoch, top, len(log.entries), entries)

    def page(self, channel: str, after: int, count: int, max_bytes: int = PAGE_BYTES) -> list[HistoryEntry]:
        """Up to ``count`` kept entries after ``seq`` ``after``, no more than ``max_bytes``
        of text (at least one entry)."""
        log = self._logs.get(channel)
        if log is None:
            return []
        out: list[HistoryEntry] = []
        used = 0
        for entry in log.entries:
            if entry.seq > after:
                used += len(entry.text)
                if out and used > max_bytes:
                    break
                out.append(entry)
                if len(out) == count:
                    break
        return out
