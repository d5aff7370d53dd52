"""The cluster backplane on Redis: keys of its own under ``KEY_PREFIX``, and Redis pub/sub.

Each process subscribes, on one pub/sub connection of its own, to the Redis channel of
every channel it has local subscribers for (``<prefix>:ch:<group name>``); a publication
is numbered, kept (a channel with history) and published in **one** Lua call, so it costs
the publisher one round trip and Redis one ``PUBLISH`` whatever the number of processes,
and reaches each subscribed process in ``seq`` order. A lease per ticker channel (``SET NX
PX``, renewed by its holder) elects the one process that runs the ticker; a Lua ``INCR``
numbers publications cluster-wide, above a floor the publisher supplies, so ``seq``
survives a failover and never goes back even when Redis loses its data. Probes are keys
with a TTL, so the cluster view lists live processes only.

Nothing here depends on a channel layer's stored format: the layer (channels-redis'
``RedisChannelLayer`` or ``RedisPubSubChannelLayer``) only says where Redis is, when
``REDIS_URL`` does not. Nothing is assumed to stay in Redis either: :meth:`check` keeps a
sentinel key per process whose disappearance (restart, flush, eviction) or expiry (every
``REASSERT_INTERVAL_MS``) tells the hub to subscribe again and reseed every sequence, and
the pub/sub connection subscribes again by itself when it reconnects.

Pub/sub keeps nothing for a process that is away (down, or cut for reading too slowly):
state channels are whole again at their next frame; channels with history count the gap
and their clients resume it (docs/recovery.md). Presence is a hash per channel of each
process's part, each under that process's lease (:mod:`realtime_app.wire.presence`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from realtime_app.cancellation import cancel_and_wait, uninterrupted
from realtime_app.cluster import redis_scripts as scripts
from realtime_app.cluster.base import Backplane, Deliver, Delivery, now_ms
from realtime_app.cluster.hosts import close_client, host_label, redis_client, shard_hosts
from realtime_app.cluster.redis_presence import RedisPresence
from realtime_app.inbound.admission import retry_after_ms
from realtime_app.observability.schema import ProcessProbe, ShardProbe
from realtime_app.wire.history import PAGE, PAGE_BYTES, HistoryEntry, HistoryPolicy, HistoryRead, Since, epoch_suffix
from realtime_app.wire.names import group_name
from realtime_app.wire.protocol import notification_head

__all__ = ["ClusterModeRefused", "RedisBackplane"]

logger = logging.getLogger("realtime_app.backplane")


#: How long one read of the idle pub/sub connection waits (a SUBSCRIBE wakes it earlier).
IDLE_READ_S = 5.0


class ClusterModeRefused(RedisError):
    """The server is a Redis Cluster node: not used (an outage until it is configured away)."""


class RedisBackplane(RedisPresence, Backplane):
    """A cluster of processes sharing one Redis (or one shard of several): its keys, and
    its pub/sub."""

    clustered = True
    errors: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)

    def __init__(
        self,
        *,
        instance_id: str = "headless",
        config: dict[str, Any] | None = None,
        redis: Any = None,
        hosts: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(instance_id=instance_id, config=config)
        from realtime_app.conf import with_defaults

        settings = with_defaults(config)
        self.prefix: str = settings["KEY_PREFIX"]
        self.lease_ttl_ms: int = settings["LEASE_TTL_MS"]
        self.seq_ttl_ms: int = settings["SEQ_IDLE_TTL_MS"]
        self.reassert_ms: int = settings["REASSERT_INTERVAL_MS"]
        host = (hosts or shard_hosts(settings) or [{}])[0]
        self.address = host_label(host)
        self.redis = redis if redis is not None else redis_client(settings, host)
        self._owns_pool = redis is None  # a pool made here is closed by stop()
        script = self.script
        self._renew = script(scripts.RENEW)
        self._release = script(scripts.RELEASE)
        self._seq = script(scripts.SEQ)
        self._reseed = script(scripts.RESEED)
        self._take = script(scripts.TAKE)
        self._once = {name: script(getattr(scripts, f"{name.upper()}_ONCE")) for name in ONCE}
        self._publish = script(scripts.PUBLISH)
        self._publish_kept = script(scripts.PUBLISH_KEPT)
        self._publish_kept_once = script(scripts.PUBLISH_KEPT_ONCE)
        self._read_kept = script(scripts.READ_KEPT)
        self._read_page = script(scripts.READ_PAGE)
        self._presence = {k: script(getattr(scripts, f"PRESENCE_{k}")) for k in ("PUT", "READ", "ALIVE")}
        self._pubsub: Any = None
        # SUBSCRIBE / UNSUBSCRIBE waiting for the receiver, the only task that uses the pub/sub
        # connection (two tasks reconnecting it at once read the same socket); a message on
        # the process's own channel wakes the receiver for them.
        self._commands: list[tuple[str, list[bytes], asyncio.Future[None]]] = []
        self.own_channel = f"{self.prefix}:proc:{self.instance_id}"
        self._names: dict[bytes, str] = {}  # Redis channel -> channel, for what this process subscribed
        self._leaving: dict[bytes, int] = {}  # unsubscribes asked for and not yet confirmed
        self._probes: dict[str, tuple[bytes, ProcessProbe]] = {}  # the others' probes as last read
        self._receive_errors: set[type[BaseException]] = set()  # logged once per kind
        self._run_id: str | None = None
        self._receiver: asyncio.Task[None] | None = None
        self.refuse_cluster = True  # a Redis Cluster node is refused (not its own node backplane)

    #: The pub/sub verbs of a channel's Redis channel (a Redis Cluster node: the sharded ones).
    SUBSCRIBE, UNSUBSCRIBE, MESSAGE = "subscribe", "unsubscribe", "message"

    def script(self, text: str) -> Any:
        return self.redis.register_script(text)

    def key(self, kind: str, channel: str) -> str:
        return f"{self.prefix}:{kind}:{group_name(channel)}"

    def once_key(self, name: str) -> str:
        """The key of a call run once, on the shard of its name."""
        return f"{self.prefix}:{name}"

    def home_key(self, name: str) -> str:
        """A key of the cluster's own state (instances, probes, shared buckets)."""
        return f"{self.prefix}:{name}"

    @property
    def alive_key(self) -> str:
        """This process's sentinel key on this server (:meth:`check`)."""
        return f"{self.prefix}:alive:{self.instance_id}"

    def redis_channel(self, channel: str) -> str:
        """The Redis pub/sub channel that carries ``channel``'s frames (named as its keys are)."""
        return self.key("ch", channel)

    # -- lifecycle ----------------------------------------------------------------

    async def start(self, deliver: Deliver) -> None:
        # One pub/sub connection, subscribed first to a channel of this process's own so
        # that it exists (and reconnects) before any channel is joined.
        pubsub = self.redis.pubsub()  # (confirmations read and skipped: an unsubscribe may be the server's)
        try:
            await pubsub.subscribe(self.own_channel)
        except BaseException:  # unreachable, or cancelled: nothing left open
            with contextlib.suppress(Exception):
                await uninterrupted(pubsub.aclose())
            raise
        self._pubsub = pubsub
        self._receiver = asyncio.get_running_loop().create_task(self._receive(deliver), name="realtime-receive")

    async def stop(self) -> None:
        """Stopped to the end once begun, whatever the caller hears meanwhile (a cancel
        of a half-done stop would leave connections open that nothing owns any more)."""
        await uninterrupted(self._stop())

    async def _stop(self) -> None:
        self.outage.stop()
        receiver, self._receiver = self._receiver, None
        await cancel_and_wait(receiver)
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(*self.errors):
                await pubsub.aclose()
        if self._owns_pool:
            await close_client(self.redis)
        else:  # a client given: its pool is its owner's to close
            await self.redis.aclose()

    async def _receive(self, deliver: Deliver) -> None:
        pubsub = self._pubsub
        assert pubsub is not None
        while True:
            try:
                await self._run_commands(pubsub)
                message = await pubsub.get_message(ignore_subscribe_messages=False, timeout=IDLE_READ_S)
            except asyncio.CancelledError:
                raise
            except RedisTimeout:
                continue  # an idle read outliving the socket timeout: not an outage
            except self.errors as exc:
                if self.refused(exc):
                    continue
                self.outage.failed(exc)
                await asyncio.sleep(0.5)
                continue
            except Exception as exc:  # never stop receiving
                if type(exc) not in self._receive_errors:
                    self._receive_errors.add(type(exc))
                    logger.exception("receiving from the backplane failed; going on")
                await asyncio.sleep(0.1)
                continue
            if message is None:
                continue
            if message.get("type") != self.MESSAGE:
                if message.get("type") == self.UNSUBSCRIBE:
                    self._unsubscribed(message["channel"])
                continue
            channel = self._names.get(message["channel"])
            if channel is None:
                continue  # a channel this process left meanwhile
            try:
                delivery = _delivery(channel, message["data"])
                if delivery.kind == "released" and delivery.text == self.instance_id:
                    continue  # its own release
                await deliver(delivery)
            except asyncio.CancelledError:
                raise
            except Exception:  # a delivery must never stop this process's receiving
                logger.exception("delivering a backplane message failed")

    async def check(self) -> bool:
        """False when the sentinel key vanished (restart, flush, eviction; and every
        ``REASSERT_INTERVAL_MS``) or Redis' ``run_id`` changed (a restart that restored a
        snapshot brings the sentinel back, not what happened since)."""
        if (
            self._run_id is None
            and self.refuse_cluster
            and int((await self.redis.info("cluster")).get("cluster_enabled", 0))
        ):
            raise ClusterModeRefused(
                f"{self.address} is a Redis Cluster node: set REALTIME_APP['REDIS_CLUSTER'] to the cluster's "
                "node URLs instead (docs/redis-cluster.md), and keep the channel layer on a plain Redis"
            )
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.alive_key, 1, nx=True, px=self.reassert_ms)
            pipe.info("server")
            created, info = await pipe.execute()
        run_id, self._run_id = self._run_id, str(info.get("run_id", ""))
        return not created and run_id in (None, self._run_id)

    # -- groups and publications -----------------------------------------------------

    async def join(self, channels: list[str]) -> None:
        """Subscribe to each channel's Redis channel — not again one the pub/sub
        connection holds (redis-py subscribes it again on every reconnect): a re-assert of
        20,000 idle rooms re-subscribed each every minute."""
        names = {self.redis_channel(channel).encode(): channel for channel in channels}
        self._names.update(names)
        held = self._held_names()
        fresh = [name for name in names if name not in held or name in self._leaving]  # leaving: asked again
        if fresh:
            await self._command(self.SUBSCRIBE, fresh)

    def _held_names(self) -> Any:
        """The Redis channels the pub/sub connection holds or has asked for."""
        return self._pubsub.channels if self._pubsub is not None else {}

    async def leave(self, channel: str) -> None:
        name = self.redis_channel(channel).encode()
        self._names.pop(name, None)
        self._leaving[name] = self._leaving.get(name, 0) + 1  # its confirmation is ours
        try:
            await self._command(self.UNSUBSCRIBE, [name])
        except BaseException:
            self._unsubscribed(name, ours_only=True)
            raise

    def _unsubscribed(self, name: bytes, *, ours_only: bool = False) -> None:
        """An unsubscribe confirmed: one this process asked for, else the server's own."""
        pending = self._leaving.get(name, 0)
        if pending:
            if pending == 1:
                del self._leaving[name]
            else:
                self._leaving[name] = pending - 1
        elif not ours_only and name in self._names:
            self.dropped(name)  # by the server (a Redis Cluster slot moved)

    async def _command(self, verb: str, names: list[bytes]) -> None:
        """Have the receiver send ``verb`` on the pub/sub connection, and wait for it."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._commands.append((verb, names, future))
        try:
            await self.redis.publish(self.own_channel, b"w 0 - wake")  # the receiver reads it and runs the command
            await future
        except BaseException:
            future.cancel()  # (the receiver skips it)
            raise

    async def _run_commands(self, pubsub: Any) -> None:
        commands, self._commands = self._commands, []
        for verb, names, future in commands:
            if future.done():
                continue
            try:
                await self._send(pubsub, verb, names)
            except self.errors as exc:
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(None)

    async def _send(self, pubsub: Any, verb: str, names: list[bytes]) -> None:
        await getattr(pubsub, verb)(*names)

    def dropped(self, name: bytes) -> None:
        """The server unsubscribed this process from ``name`` (a Redis Cluster slot moved)."""

    def refused(self, exc: BaseException) -> bool:
        """True when ``exc``, read on the pub/sub connection, is a subscription refused by a
        server that answers (a Redis Cluster node), handled: not an outage."""
        return False

    def _kept_keys(self, channel: str) -> list[str]:
        return [
            self.key("seq", channel),
            self.key("epoch", channel),
            self.key("history", channel),
            self.key("history-largest", channel),
        ]

    async def publish(self, channel: str, data_json: str, floor: int = 0, history: HistoryPolicy | None = None) -> int:
        ts = now_ms()
        head = notification_head(channel, data_json)
        if history is None:
            keys = [self.key("seq", channel), self.redis_channel(channel)]
            return int(await self._publish(keys=keys, args=[floor, self.seq_ttl_ms, head, ts]))
        seq_, epoch_ = await self._publish_kept(
            keys=[*self._kept_keys(channel), self.redis_channel(channel)],
            args=[epoch_suffix(), self._keep_ms(history), floor, head, ts, history.size, history.ttl_ms],
        )
        return self._counted(channel, seq_, epoch_, history)

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

    def _keep_ms(self, history: HistoryPolicy) -> int:
        """How long a channel's seq, epoch and history keys live (its lineage outlives its history)."""
        return max(self.seq_ttl_ms, history.ttl_ms, scripts.KEEP_LINEAGE_MS)

    def _counted(self, channel: str, seq_: Any, epoch_: Any, history: HistoryPolicy) -> int:
        """A kept publication's seq; the history's size counted (exactly again at each read)."""
        seq, epoch = int(seq_), _text(epoch_)
        seen, kept = self.histories.get(channel, ("", 0))
        self.histories[channel] = (epoch, min(history.size, kept + 1) if seen == epoch else 1)
        return seq

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
        epoch = _text(epoch_)
        self.histories[channel] = (epoch, int(size))
        return HistoryRead(epoch, int(top), int(size), _entries(raw), created=bool(created))

    async def history_page(
        self, channel: str, after: int, count: int, max_bytes: int = PAGE_BYTES
    ) -> list[HistoryEntry]:
        keys = [self.key("history", channel), self.key("history-largest", channel)]
        return _entries(await self._read_page(keys=keys, args=[after, count, max_bytes]))

    async def reseed(self, floors: dict[str, int]) -> None:
        if not floors:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for channel, floor in floors.items():
                await self._reseed(keys=[self.key("seq", channel)], args=[floor, self.seq_ttl_ms], client=pipe)
            await pipe.execute()

    # -- leases -----------------------------------------------------------------------

    async def acquire(self, channel: str) -> bool:
        return bool(await self.redis.set(self.key("lease", channel), self.instance_id, nx=True, px=self.lease_ttl_ms))

    async def renew(self, channel: str) -> bool:
        return bool(await self._renew(keys=[self.key("lease", channel)], args=[self.instance_id, self.lease_ttl_ms]))

    async def release(self, channel: str) -> None:
        await self._release(keys=[self.key("lease", channel), self.redis_channel(channel)], args=[self.instance_id])

    # -- probes -----------------------------------------------------------------------

    async def put_probe(self, probe: ProcessProbe, ttl_ms: int) -> None:
        now = now_ms()
        instances = self.home_key("instances")
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.home_key(f"probe:{self.instance_id}"), json.dumps(probe), px=ttl_ms)
            pipe.zadd(instances, {self.instance_id: now + ttl_ms})
            pipe.zremrangebyscore(instances, "-inf", now)
            pipe.pexpire(instances, ttl_ms)  # gone with the last live process's probe
            await pipe.execute()

    async def drop_probe(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.home_key(f"probe:{self.instance_id}"))
            pipe.delete(self.alive_key)
            pipe.zrem(self.home_key("instances"), self.instance_id)
            await pipe.execute()

    async def drop_alive(self) -> None:
        """Withdraw this process's sentinel key (a shard other than the home one)."""
        await self.redis.delete(self.alive_key)

    async def cluster_probes(self) -> list[ProcessProbe]:
        """The other live processes' probes (this process's own is its hub's, fresh). A
        probe is republished every few seconds and read far more often: one whose bytes
        did not change is not decoded again (callers do not change what they are given)."""
        ids = await self.redis.zrangebyscore(self.home_key("instances"), now_ms(), "+inf")
        names = [name for name in map(_text, ids) if name != self.instance_id]
        raw = await self.redis.mget([self.home_key(f"probe:{n}") for n in names]) if names else []
        seen, self._probes = self._probes, {}
        for name, data in zip(names, raw, strict=True):
            if data:
                known = seen.get(name)
                self._probes[name] = (data, known[1] if known is not None and known[0] == data else json.loads(data))
        return [probe for _, probe in self._probes.values()]

    def shards_probe(self) -> list[ShardProbe]:
        return [{"index": 0, "address": self.address, "up": not self.outage.down, "outages": self.outage.outages}]

    # -- admission ----------------------------------------------------------------------

    async def take_tokens(self, identity: str, cost: float, capacity: float, refill_per_s: float) -> int | None:
        refill_ms = int(capacity / refill_per_s * 1000) + 1000  # a full bucket needs no key
        wait = await self._take(
            keys=[self.home_key(f"bucket:{identity}")], args=[repr(cost), repr(capacity), repr(refill_per_s), refill_ms]
        )
        seconds = float(wait.decode() if isinstance(wait, bytes) else wait)
        return retry_after_ms(seconds) if seconds > 0 else None

    async def claim_once(self, name: str, owner: str, ttl_ms: int) -> tuple[Any, str | None]:
        state, answer = await self._once["claim"](keys=[self.once_key(name)], args=[owner, ttl_ms])
        return _text(state), _text(answer) if _text(state) == "answer" else None

    async def keep_once(self, name: str, owner: str, answer: str, ttl_ms: int) -> None:
        await self._once["keep"](keys=[self.once_key(name)], args=[owner, answer, ttl_ms])

    async def renew_once(self, name: str, owner: str, ttl_ms: int) -> None:
        await self._once["renew"](keys=[self.once_key(name)], args=[owner, ttl_ms])


#: The scripts of calls that run once (``redis_scripts.CLAIM_ONCE`` …).
ONCE = ("claim", "keep", "renew")


def _entries(raw: list[Any]) -> list[HistoryEntry]:
    """Stream entries ``[id, [field, value, …]]`` as :class:`HistoryEntry`."""
    entries = []
    for entry_id, values in raw:
        if isinstance(values, dict):
            fields = {_text(k): v for k, v in values.items()}
        else:
            fields = {_text(k): v for k, v in zip(values[::2], values[1::2], strict=True)}
        seq = int(_text(entry_id).partition("-")[0])
        entries.append(HistoryEntry(seq, int(fields["ts"]), _text(fields["t"])))
    return entries


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _delivery(channel: str, data: bytes) -> Delivery:
    """A message of a channel's Redis channel (see :data:`.redis_scripts.PUBLISH`) as a :class:`Delivery`."""
    kind, seq, epoch, rest = data.split(b" ", 3)
    if kind == b"f":
        return Delivery("frame", channel, rest.decode(), int(seq), "" if epoch == b"-" else epoch.decode())
    if kind == b"r":
        return Delivery("released", channel, rest.decode())
    raise ValueError(f"unknown backplane message kind {kind!r}")
