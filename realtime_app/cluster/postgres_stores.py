"""What the PostgreSQL backplane keeps (a mixin of
:class:`~realtime_app.cluster.postgres.PostgresBackplane`): the
:class:`~realtime_app.cluster.roles.HistoryStore`, :class:`~realtime_app.cluster.roles.PresenceStore`,
:class:`~realtime_app.cluster.roles.LeaseStore` and :class:`~realtime_app.cluster.roles.OnceStore`
roles, each method one call of a function of :mod:`realtime_app.cluster.postgres_sql`."""

from __future__ import annotations

import json
from typing import Any

from realtime_app.cluster.base import PRESENCE_KEEP_MS, Lineages
from realtime_app.cluster.redis_scripts import READ_KEEP_MIN_MS
from realtime_app.cluster.roles import now_ms
from realtime_app.inbound.admission import retry_after_ms
from realtime_app.observability.schema import ProcessProbe
from realtime_app.wire.history import PAGE, PAGE_BYTES, HistoryEntry, HistoryPolicy, HistoryRead, Since, epoch_suffix
from realtime_app.wire.names import group_name as _group
from realtime_app.wire.protocol import notification_head

__all__ = ["PostgresStores"]


class PostgresStores(Lineages):
    """History, presence, leases, probes, shared buckets and calls run once, in the
    backplane's tables."""

    pool: Any
    instance_id: str
    lease_ttl_ms: int
    seq_ttl_ms: int
    histories: dict[str, tuple[str, int]]
    _probes: dict[str, tuple[str, ProcessProbe]]

    def key(self, kind: str, channel: str) -> str:
        raise NotImplementedError

    def scope(self, kind: str) -> str:
        raise NotImplementedError

    def notify_channel(self, channel: str) -> str:
        raise NotImplementedError

    # -- history ----------------------------------------------------------------------

    async def publish_kept(self, channel: str, head: str, floor: int, history: HistoryPolicy) -> int:
        """Number, keep and notify one publication of a channel with history."""
        seq, epoch = await self.pool.one(
            "SELECT * FROM realtime_app_bp_publish_kept(%s, %s, %s, %s, %s, %s, %s, %s, %s)",
            [*self._kept_args(channel, floor, history), head, now_ms(), history.size, history.ttl_ms],
        )
        return self._counted(channel, int(seq), epoch, history)

    def _kept_args(self, channel: str, floor: int, history: HistoryPolicy) -> list[Any]:
        return [self.key("seq", channel), self.notify_channel(channel), epoch_suffix(), self._keep_ms(history), floor]

    async def history(
        self, channel: str, policy: HistoryPolicy, since: Since | None = None, floor: int = 0
    ) -> HistoryRead:
        epoch, top, size, created, seqs, stamps, bodies = await self.pool.one(
            "SELECT * FROM realtime_app_bp_read_kept(%s, %s, %s, %s, %s, %s, %s, %s, %s)",
            [
                self.key("seq", channel),
                epoch_suffix(),
                since.seq if since else -1,
                since.epoch if since else "",
                policy.size,
                PAGE,
                floor,
                PAGE_BYTES,
                max(policy.ttl_ms, READ_KEEP_MIN_MS),
            ],
        )
        self.histories[channel] = (epoch, int(size))
        rows = zip(seqs or (), stamps or (), bodies or (), strict=True)
        entries = [HistoryEntry(int(seq), int(ts), body) for seq, ts, body in rows]
        return HistoryRead(epoch, int(top), int(size), entries, created=bool(created))

    async def history_page(
        self, channel: str, after: int, count: int, max_bytes: int = PAGE_BYTES
    ) -> list[HistoryEntry]:
        rows = await self.pool.all(
            "SELECT * FROM realtime_app_bp_page(%s, %s, %s, %s)", [self.key("seq", channel), after, count, max_bytes]
        )
        return [HistoryEntry(int(seq), int(ts), body) for seq, ts, body in rows]

    # -- presence ---------------------------------------------------------------------

    async def presence_alive(self, ttl_ms: int) -> tuple[int, bool] | None:
        """Mark this process alive for ``ttl_ms``: ``(how long its parts are kept, whether
        its mark was still there)``."""
        (was,) = await self.pool.one(
            "SELECT realtime_app_bp_put(%s, %s, '', %s)", [self.scope("presence-alive"), self.instance_id, ttl_ms]
        )
        return PRESENCE_KEEP_MS, bool(was)

    async def put_presence(self, parts: dict[str, str | None], ttl_ms: int, alive: bool = False) -> None:
        if not parts:
            return
        member = "@" + self.instance_id if alive else self.instance_id
        scope = self.scope("presence-alive")  # every writer drops the parts of processes whose mark lapsed
        keys = sorted(parts, key=lambda channel: self.key("presence", channel))  # one order: no deadlock
        await self.pool.one(
            "SELECT count(*) FROM unnest(%s::text[], %s::text[]) AS t(k, p), "
            "LATERAL realtime_app_bp_presence_put(t.k, %s, t.p, %s, %s)",
            [[self.key("presence", c) for c in keys], [parts[c] or "" for c in keys], member, ttl_ms, scope],
        )

    async def read_presence(self, known: dict[str, str]) -> dict[str, tuple[str, list[str]] | None]:
        if not known:
            return {}
        channels = sorted(known, key=lambda channel: self.key("presence", channel))
        rows = await self.pool.all(
            "SELECT r.version, r.parts FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS t(k, v, n), "
            "LATERAL realtime_app_bp_presence_read(t.k, t.v, %s) AS r ORDER BY t.n",
            [[self.key("presence", c) for c in channels], [known[c] for c in channels], self.scope("presence-alive")],
        )
        out: dict[str, tuple[str, list[str]] | None] = {}
        for channel, (version, parts) in zip(channels, rows, strict=True):
            out[channel] = None if version == known[channel] else (version, list(parts or ()))
        return out

    # -- leases and probes ------------------------------------------------------------

    async def acquire(self, channel: str) -> bool:
        return await self._lease(channel, mine=False)

    async def renew(self, channel: str) -> bool:
        return await self._lease(channel, mine=True)

    async def _lease(self, channel: str, *, mine: bool) -> bool:
        (got,) = await self.pool.one(
            "SELECT realtime_app_bp_lease(%s, %s, %s, %s, %s)",
            [self.scope("lease"), _group(channel), self.instance_id, self.lease_ttl_ms, mine],
        )
        return bool(got)

    async def release(self, channel: str) -> None:
        await self.pool.one(
            "SELECT realtime_app_bp_release(%s, %s, %s, %s)",
            [self.scope("lease"), _group(channel), self.instance_id, self.notify_channel(channel)],
        )

    async def lease_holder(self, channel: str) -> str | None:
        """Which process holds ``channel``'s lease now (for the tests and the screen)."""
        row = await self.pool.one(
            "SELECT value FROM realtime_app_bp_key "
            "WHERE scope = %s AND name = %s AND expires_at > realtime_app_bp_now()",
            [self.scope("lease"), _group(channel)],
        )
        return row[0] if row else None

    async def put_probe(self, probe: ProcessProbe, ttl_ms: int) -> None:
        await self.pool.one(
            "SELECT realtime_app_bp_put(%s, %s, %s, %s)",
            [self.scope("probe"), self.instance_id, json.dumps(probe), ttl_ms],
        )

    async def drop_probe(self) -> None:
        await self.pool.run(
            "DELETE FROM realtime_app_bp_key WHERE (scope = %s OR scope = %s) AND name = %s",
            [self.scope("probe"), self.scope("alive"), self.instance_id],
        )

    async def cluster_probes(self) -> list[ProcessProbe]:
        """The other live processes' probes; one whose text did not change is not decoded again."""
        rows = await self.pool.all(
            "SELECT name, value FROM realtime_app_bp_key WHERE scope = %s AND name <> %s "
            "AND expires_at > realtime_app_bp_now() ORDER BY name",
            [self.scope("probe"), self.instance_id],
        )
        seen, self._probes = self._probes, {}
        for name, data in rows:
            known = seen.get(name)
            self._probes[name] = (data, known[1] if known is not None and known[0] == data else json.loads(data))
        return [probe for _, probe in self._probes.values()]

    async def take_tokens(self, identity: str, cost: float, capacity: float, refill_per_s: float) -> int | None:
        refill_ms = int(capacity / refill_per_s * 1000) + 1000
        (wait,) = await self.pool.one(
            "SELECT realtime_app_bp_take(%s, %s, %s, %s, %s, %s)",
            [self.scope("bucket"), identity, cost, capacity, refill_per_s, refill_ms],
        )
        return retry_after_ms(float(wait)) if wait > 0 else None

    # -- calls run once ---------------------------------------------------------------

    async def claim_once(self, name: str, owner: str, ttl_ms: int) -> tuple[Any, str | None]:
        state, answer = await self.pool.one(
            "SELECT * FROM realtime_app_bp_claim_once(%s, %s, %s, %s)", [self.scope("once"), name, owner, ttl_ms]
        )
        return state, answer if state == "answer" else None

    async def keep_once(self, name: str, owner: str, answer: str, ttl_ms: int) -> None:
        await self.pool.one(
            "SELECT realtime_app_bp_keep_once(%s, %s, %s, %s, %s)", [self.scope("once"), name, owner, answer, ttl_ms]
        )

    async def renew_once(self, name: str, owner: str, ttl_ms: int) -> None:
        await self.pool.one(
            "SELECT realtime_app_bp_renew_once(%s, %s, %s, %s)", [self.scope("once"), name, owner, ttl_ms]
        )

    async def publish_once(
        self, channel: str, data_json: str, floor: int, history: HistoryPolicy, key: str, window_ms: int
    ) -> int | None:
        seq, epoch = await self.pool.one(
            "SELECT * FROM realtime_app_bp_publish_kept_once(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            [
                *self._kept_args(channel, floor, history),
                notification_head(channel, data_json),
                now_ms(),
                history.size,
                history.ttl_ms,
                self.scope(f"outbox-done:{_group(channel)}"),
                key,
                window_ms,
            ],
        )
        if int(seq) == -1:  # published already, within the window
            return None
        return self._counted(channel, int(seq), epoch, history)
