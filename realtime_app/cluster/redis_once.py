"""Calls that run once, on Redis (a mixin of :class:`~realtime_app.cluster.redis.RedisBackplane`,
the :class:`~realtime_app.cluster.roles.OnceStore` role): a key per idempotency key
(claimed, running, answered) and the outbox's publications made once within a window."""

from __future__ import annotations

from typing import Any

from realtime_app.cluster.redis_history import RedisHistory
from realtime_app.cluster.redis_scripts import text
from realtime_app.cluster.roles import now_ms
from realtime_app.wire.history import HistoryPolicy, epoch_suffix
from realtime_app.wire.protocol import notification_head

__all__ = ["ONCE", "RedisOnce"]

#: The scripts of calls that run once (``redis_scripts.CLAIM_ONCE`` …).
ONCE = ("claim", "keep", "renew")


class RedisOnce(RedisHistory):
    """``claim_once``, ``keep_once``, ``renew_once`` and ``publish_once`` of one Redis server."""

    _once: dict[str, Any]
    _publish_kept_once: Any

    def once_key(self, name: str) -> str:
        raise NotImplementedError

    def redis_channel(self, channel: str) -> str:
        raise NotImplementedError

    async def publish_once(
        self, channel: str, data_json: str, floor: int, history: HistoryPolicy, key: str, window_ms: int
    ) -> int | None:
        ts = now_ms()
        head = notification_head(channel, data_json)
        seq_, epoch_ = await self._publish_kept_once(
            keys=[*self._kept_keys(channel), self.redis_channel(channel), self.key("outbox-done", channel)],
            args=[epoch_suffix(), self._keep_ms(history), floor, head, ts, history.size]
            + [history.ttl_ms, key, ts, window_ms],
        )
        if int(seq_) == -1:  # published already, within the window  # pragma: no mutate (<= -1: seqs are >= 1)
            return None
        return self._counted(channel, seq_, epoch_, history)

    async def claim_once(self, name: str, owner: str, ttl_ms: int) -> tuple[Any, str | None]:
        state, answer = await self._once["claim"](keys=[self.once_key(name)], args=[owner, ttl_ms])
        return text(state), text(answer) if text(state) == "answer" else None

    async def keep_once(self, name: str, owner: str, answer: str, ttl_ms: int) -> None:
        await self._once["keep"](keys=[self.once_key(name)], args=[owner, answer, ttl_ms])

    async def renew_once(self, name: str, owner: str, ttl_ms: int) -> None:
        await self._once["renew"](keys=[self.once_key(name)], args=[owner, ttl_ms])
