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
import logging
from typing import Any

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeout

from realtime_app.cancellation import cancel_and_wait, uninterrupted
from realtime_app.cluster import redis_scripts as scripts
from realtime_app.cluster.base import Backplane, Deliver, delivery, now_ms
from realtime_app.cluster.hosts import close_client, host_label, redis_client, shard_hosts
from realtime_app.cluster.redis_leases import RedisLeases
from realtime_app.cluster.redis_once import ONCE, RedisOnce
from realtime_app.cluster.redis_presence import RedisPresence
from realtime_app.observability.schema import ProcessProbe
from realtime_app.wire.history import HistoryPolicy, epoch_suffix
from realtime_app.wire.names import group_name
from realtime_app.wire.protocol import notification_head

__all__ = ["ClusterModeRefused", "RedisBackplane"]

logger = logging.getLogger("realtime_app.backplane")


#: How long one read of the idle pub/sub connection waits (a SUBSCRIBE wakes it earlier).
IDLE_READ_S = 5.0


class ClusterModeRefused(RedisError):
    """The server is a Redis Cluster node: not used (an outage until it is configured away)."""


class RedisBackplane(RedisPresence, RedisLeases, RedisOnce, Backplane):
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
        settings = self._cluster_settings(config)
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
                arrived = delivery(channel, message["data"])
                if arrived.kind == "released" and arrived.text == self.instance_id:
                    continue  # its own release
                await deliver(arrived)
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

    async def reseed(self, floors: dict[str, int]) -> None:
        if not floors:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for channel, floor in floors.items():
                await self._reseed(keys=[self.key("seq", channel)], args=[floor, self.seq_ttl_ms], client=pipe)
            await pipe.execute()
