"""Channels' history on Redis (a mixin of :class:`~realtime_app.cluster.redis.RedisBackplane`,
the :class:`~realtime_app.cluster.roles.HistoryStore` role): a stream per channel under its
epoch, its ``seq`` and epoch keys, read back by ``{seq, epoch}`` a page at a time."""

from __future__ import annotations

from typing import Any

from realtime_app.cluster import redis_scripts as scripts
from realtime_app.cluster.base import Lineages
from realtime_app.cluster.redis_scripts import text
from realtime_app.wire.history import PAGE, PAGE_BYTES, HistoryEntry, HistoryPolicy, HistoryRead, Since, epoch_suffix

__all__ = ["RedisHistory", "entries"]


class RedisHistory(Lineages):
    """``history`` and ``history_page`` of one Redis server, and the keys they share with
    a kept publication."""

    seq_ttl_ms: int
    histories: dict[str, tuple[str, int]]
    _read_kept: Any
    _read_page: Any

    def key(self, kind: str, channel: str) -> str:
        raise NotImplementedError

    def _kept_keys(self, channel: str) -> list[str]:
        return [
            self.key("seq", channel),
            self.key("epoch", channel),
            self.key("history", channel),
            self.key("history-largest", channel),
        ]

    async def history(
        self, channel: str, policy: HistoryPolicy, since: Since | None = None, floor: int = 0
    ) -> HistoryRead:
        epoch_, top, size, raw, created = await self._read_kept(
            keys=self._kept_keys(channel),
            args=[
                epoch_suffix(),
                0,
                since.seq if since else -1,
                since.epoch if since else "",
                policy.size,
                PAGE,
                floor,
                PAGE_BYTES,
                max(policy.ttl_ms, scripts.READ_KEEP_MIN_MS),
            ],
        )
        epoch = text(epoch_)
        self.histories[channel] = (epoch, int(size))
        return HistoryRead(epoch, int(top), int(size), entries(raw), created=bool(created))

    async def history_page(
        self, channel: str, after: int, count: int, max_bytes: int = PAGE_BYTES
    ) -> list[HistoryEntry]:
        keys = [self.key("history", channel), self.key("history-largest", channel)]
        return entries(await self._read_page(keys=keys, args=[after, count, max_bytes]))


def entries(raw: list[Any]) -> list[HistoryEntry]:
    """Stream entries ``[id, [field, value, …]]`` as :class:`HistoryEntry`."""
    entries = []
    for entry_id, values in raw:
        if isinstance(values, dict):
            fields = {text(k): v for k, v in values.items()}
        else:
            fields = {text(k): v for k, v in zip(values[::2], values[1::2], strict=True)}
        seq = int(text(entry_id).partition("-")[0])
        entries.append(HistoryEntry(seq, int(fields["ts"]), text(fields["t"])))
    return entries
