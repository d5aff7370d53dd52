"""The backplane on a Redis Cluster (``REDIS_CLUSTER``): the distributed Redis that managed
offerings hand out (cluster mode), with its replicas and failover.

Every key of one channel — count, epoch, history, lease, presence, app-fed value — carries
the channel's hash tag (``{<group name>}``), so each of its scripts runs on one slot, and
its frames go out with ``SPUBLISH`` on that slot's master: sharded pub/sub reaches the
processes subscribed on that shard only, instead of every node of the cluster. The
cluster's own state (instances, probes, shared buckets) is on one slot (``{home}``).

The slots are read with ``CLUSTER SHARDS`` from the startup nodes (or any master known),
and each master is carried by a :class:`ClusterNode` — the one-server backplane with the
cluster's key names, scripts and verbs — exactly as the client-side shards are
(:class:`~realtime_app.cluster.shards.ShardedBackplane`: one node never holds the others
up). The map is read again when a call meets ``MOVED`` (and the call made once more on
the new owner), when a node stops answering (a failover: at the next beat), and when a
master unsubscribes this process from a channel (its slot moved: the channel is joined
again on its new owner at once). Each change of the map has the hub re-assert what the
backplane holds (subscriptions, sequences, leases), as after any outage.

redis-py's ``RedisCluster`` is not used: its pub/sub does not follow a failover until a
key command happens to meet ``MOVED``, and its keyspace calls would not share the
stalling, bounds and re-asserting of the shards (docs/redis-cluster.md says where
redis-py stops and what is here instead). Its public ``redis.crc.key_slot`` is.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.crc import key_slot
from redis.exceptions import AskError

from realtime_app.cancellation import cancel_and_wait
from realtime_app.channels.registry import FED_PREFIX
from realtime_app.cluster.hosts import redis_client
from realtime_app.cluster.redis import RedisBackplane
from realtime_app.cluster.redis_scripts import for_cluster
from realtime_app.cluster.shards import ShardedBackplane
from realtime_app.wire.names import group_name

__all__ = ["ClusterBackplane", "ClusterNode", "Topology", "parse_shards", "tag_of"]

logger = logging.getLogger("realtime_app.backplane")

T = TypeVar("T")
SLOTS = 16384
#: The hash tag of the cluster's own state: one slot, one master.
HOME_TAG = "home"
#: At most one reading of the map this often after calls fail on a node, seconds.
REMAP_EVERY_S = 0.5


def tag_of(channel: str) -> str:
    """The hash tag of ``channel``'s keys and Redis channel; an app-fed value's is its base
    channel's (one slot for both, as on the client-side shards)."""
    return group_name(channel.removeprefix(FED_PREFIX))


def slot_of(tag: str) -> int:
    return int(key_slot(tag.encode("utf-8")))


class Topology:
    """Which master serves which slots: ``{"host:port": [(first, last), ...]}``."""

    def __init__(self, masters: dict[str, list[tuple[int, int]]]) -> None:
        self.masters = masters
        self._owner = [""] * SLOTS
        for address, ranges in masters.items():
            for first, last in ranges:
                self._owner[first : last + 1] = [address] * (last - first + 1)

    def owner(self, slot: int) -> str:
        """The master of ``slot``; ``""`` when none serves it (the cluster is missing a shard)."""
        return self._owner[slot]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and self.masters == other.masters

    __hash__ = None  # type: ignore[assignment]


def parse_shards(raw: Any) -> Topology:
    """``CLUSTER SHARDS`` as redis-py returns it (RESP3 maps or RESP2 flat lists, bytes or
    text): the online master of each shard and its slots."""

    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    def mapping(value: Any) -> dict[str, Any]:
        if isinstance(value, dict):
            return {text(k): v for k, v in value.items()}
        return {text(k): v for k, v in zip(value[::2], value[1::2], strict=True)}

    masters: dict[str, list[tuple[int, int]]] = {}
    for item in raw:
        shard = mapping(item)
        slots = [int(s) for s in shard.get("slots", [])]
        nodes = [mapping(n) for n in shard.get("nodes", [])]
        master = next((n for n in nodes if text(n.get("role")) == "master" and text(n.get("health")) == "online"), None)
        if master is None or not slots:
            continue  # a shard without a serving master: its slots have no owner until a failover
        host = text(master.get("endpoint") or master.get("ip"))
        if host in ("", "?"):
            host = text(master.get("ip"))
        address = f"{host}:{int(master['port'])}"
        masters.setdefault(address, []).extend((slots[i], slots[i + 1]) for i in range(0, len(slots), 2))
    return Topology(masters)


def _tag_within(ranges: list[tuple[int, int]], stem: str) -> str:
    """A hash tag whose slot is one of ``ranges``: a key of this process on that node."""
    for i in range(SLOTS * 8):
        candidate = f"{stem}-{i}"
        slot = slot_of(candidate)
        if any(first <= slot <= last for first, last in ranges):
            return candidate
    raise ValueError(f"no tag of {stem!r} falls in {ranges}")


class ClusterNode(RedisBackplane):
    """The backplane on one master of a Redis Cluster: the one-server backplane with
    hash-tagged keys, the sharded pub/sub verbs (one channel per command: the slots of
    several differ) and scripts that publish with ``SPUBLISH``."""

    SUBSCRIBE, UNSUBSCRIBE, MESSAGE = "ssubscribe", "sunsubscribe", "smessage"

    def __init__(
        self,
        *,
        instance_id: str,
        config: dict[str, Any] | None,
        url: str,
        ranges: list[tuple[int, int]],
        on_dropped: Callable[[str], None],
    ) -> None:
        super().__init__(instance_id=instance_id, config=config, hosts=[{"address": url}])
        self.refuse_cluster = False
        self.url = url
        self.ranges = ranges
        self.node_tag = _tag_within(ranges, f"{self.prefix}-node")
        self.on_dropped = on_dropped
        # Classic pub/sub (broadcast by the cluster bus) for the wake-ups of this node's receiver.
        self.own_channel = f"{self.prefix}:proc:{self.instance_id}:{self.address}"

    def moved_to(self, ranges: list[tuple[int, int]]) -> None:
        """Serves other slots now: its sentinel key goes where it still lands here."""
        if ranges != self.ranges:
            self.ranges = ranges
            self.node_tag = _tag_within(ranges, f"{self.prefix}-node")

    def script(self, text: str) -> Any:
        return self.redis.register_script(for_cluster(text))

    def key(self, kind: str, channel: str) -> str:
        return f"{self.prefix}:{kind}:{{{tag_of(channel)}}}{group_name(channel)}"

    def redis_channel(self, channel: str) -> str:
        return f"{self.prefix}:ch:{{{tag_of(channel)}}}{group_name(channel)}"

    def home_key(self, name: str) -> str:
        return f"{self.prefix}:{{{HOME_TAG}}}:{name}"

    def once_key(self, name: str) -> str:
        return f"{self.prefix}:once:{{{tag_of(name)}}}{name}"

    @property
    def alive_key(self) -> str:
        return f"{self.prefix}:alive:{{{self.node_tag}}}:{self.instance_id}"

    async def _send(self, pubsub: Any, verb: str, names: list[bytes]) -> None:
        for name in names:
            await getattr(pubsub, verb)(name)

    def dropped(self, name: bytes) -> None:
        channel = self._names.pop(name, None)
        if channel is not None:
            # redis-py would subscribe to it again on a reconnect: unsubscribed on our side too.
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._commands.append((self.UNSUBSCRIBE, [name], future))
            self.on_dropped(channel)


def _routed(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A backplane call on the cluster: the map read first if it never was; made once more
    on the new owner when it meets ``MOVED`` (nothing ran: Redis refuses before running),
    or when it failed on a node and the map read again has moved that node's slots (a
    failover: a publisher follows it without waiting for the beat)."""

    @functools.wraps(method)
    async def routed(self: ClusterBackplane, *args: Any, **kwargs: Any) -> T:
        await self.mapped()
        try:
            return await method(self, *args, **kwargs)
        except AskError:  # MOVED (a subclass), or ASK while a slot migrates: made once more
            await self.remap()
        except self.errors:
            if not await self.remap_soon():  # a node down: a failover may have moved its slots
                raise
        return await method(self, *args, **kwargs)

    return routed


class ClusterBackplane(ShardedBackplane):
    """A :class:`ClusterNode` per master of the cluster, each channel on the master of its
    slot (see the module's docstring)."""

    not_outages = (AskError,)  # a redirection (MOVED is one): the node answered

    def __init__(self, *, instance_id: str = "headless", config: dict[str, Any] | None = None) -> None:
        super().__init__(instance_id=instance_id, config=config, hosts=[])
        from realtime_app.conf import with_defaults

        self.settings = with_defaults(config)
        self.startup: list[str] = list(self.settings["REDIS_CLUSTER"] or [])
        self.topology: Topology | None = None
        self.nodes: dict[str, ClusterNode] = {}  # by "host:port"
        self._changed = False  # the map changed since the last check: the hub re-asserts
        self._remapping = asyncio.Lock()
        self._dropped: set[str] = set()
        self._rejoin: asyncio.Task[None] | None = None
        self._remapped_at = float("-inf")

    # -- the map -------------------------------------------------------------------------

    def shard(self, channel: str) -> RedisBackplane:
        assert self.topology is not None
        owner = self.topology.owner(slot_of(tag_of(channel)))
        node = self.nodes.get(owner)
        if node is None:
            from realtime_app.cluster.shards import ShardUnavailable

            raise ShardUnavailable(f"no master of the Redis Cluster serves the slot of {channel!r} now")
        return node

    async def mapped(self) -> None:
        if self.topology is None:
            await self.remap()

    async def remap(self) -> bool:
        """Read the slots again and carry every master; True when the map changed."""
        self._remapped_at = asyncio.get_running_loop().time()
        async with self._remapping:
            topology = await self._read()
            if topology == self.topology:
                return False
            await self._adopt(topology)
            return True

    async def remap_soon(self) -> bool:
        """:meth:`remap` unless one was tried in the last :data:`REMAP_EVERY_S` (a node that
        is down fails many calls at once); True when the map changed."""
        now = asyncio.get_running_loop().time()
        if now - self._remapped_at < REMAP_EVERY_S:
            return False
        self._remapped_at = now
        try:
            return await self.remap()
        except self.errors:
            return False

    async def _read(self) -> Topology:
        """``CLUSTER SHARDS`` from the first node that answers: the masters known, then the startup nodes."""
        timeout_ms = min(self.settings["REDIS_TIMEOUT_MS"], 3000)
        urls = [node.url for node in self.nodes.values()] + [u for u in self.startup if u not in self._urls()]
        failure: BaseException | None = None
        for url in urls:
            client = redis_client({**self.settings, "REDIS_TIMEOUT_MS": timeout_ms}, {"address": url})
            try:
                topology = parse_shards(await client.execute_command("CLUSTER SHARDS"))
            except self.errors as exc:
                failure = exc
                continue
            finally:
                with contextlib.suppress(Exception):
                    await client.aclose(close_connection_pool=True)
            if topology.masters:
                return topology
        raise failure or ConnectionError("no node of REDIS_CLUSTER answered")

    def _urls(self) -> set[str]:
        return {node.url for node in self.nodes.values()}

    async def _adopt(self, topology: Topology) -> None:
        first = self.topology is None
        for address, ranges in topology.masters.items():
            node = self.nodes.get(address)
            if node is None:
                node = ClusterNode(
                    instance_id=self.instance_id,
                    config=self.config,
                    url=self._url_of(address),
                    ranges=ranges,
                    on_dropped=self._on_dropped,
                )
                node.histories = self.histories
                node.outage.what = f"Redis Cluster master {address}"
                self.nodes[address] = node
                if self._deliver is not None:  # started: so is this one (or a later check does it)
                    self._unstarted.add(node)
                    with contextlib.suppress(*self.errors):
                        await self._on(node, self._start(node), self.beat_call_s)
            else:
                node.moved_to(ranges)
        for address in [a for a in self.nodes if a not in topology.masters]:
            node = self.nodes.pop(address)
            self.stalled.discard(node)
            self._unstarted.discard(node)
            await node.stop()
        self.shards[:] = list(self.nodes.values())  # the outage's view too
        self.topology = topology
        self.home = self.shard_of_tag(HOME_TAG)
        if not first:
            self._changed = True
            logger.warning(
                "the Redis Cluster's map changed: masters %s; re-asserting what this process holds",
                ", ".join(sorted(topology.masters)),
            )

    def shard_of_tag(self, tag: str) -> RedisBackplane:
        assert self.nodes
        owner = self.nodes.get(self._owner_of(tag))
        return owner if owner is not None else next(iter(self.nodes.values()))

    def _owner_of(self, tag: str) -> str:
        topology = self.topology
        if topology is None or not self.nodes:
            return ""
        return topology.owner(slot_of(tag))

    def _url_of(self, address: str) -> str:
        """A master's URL: the startup URL's scheme, credentials and options on its address."""
        from urllib.parse import urlsplit, urlunsplit

        template = urlsplit(self.startup[0])
        credentials = template.netloc.rpartition("@")[0]
        netloc = f"{credentials}@{address}" if credentials else address
        return urlunsplit((template.scheme, netloc, "/0", template.query, ""))

    def _on_dropped(self, channel: str) -> None:
        """A master unsubscribed this process from ``channel`` (its slot moved): join it
        again on its new owner now, not at the next beat."""
        self._dropped.add(channel)
        if self._rejoin is None or self._rejoin.done():
            self._rejoin = asyncio.get_running_loop().create_task(self._join_dropped(), name="realtime-cluster-rejoin")

    async def _join_dropped(self) -> None:
        for attempt in range(20):  # the cluster's gossip may lag the failover for a moment
            channels, self._dropped = sorted(self._dropped), set()
            if not channels:
                return
            try:
                await self.remap()
                await self.join(channels)
            except self.errors as exc:
                logger.info("joining %d channels again after a slot moved: %s; retrying", len(channels), exc)
                self._dropped.update(channels)
                await asyncio.sleep(0.1 * (attempt + 1))

    # -- lifecycle -------------------------------------------------------------------

    async def start(self, deliver: Any) -> None:
        await self.remap()  # (before _deliver is set: the nodes are started here, once)
        self._deliver = deliver
        self._unstarted = set(self.shards)
        results = await asyncio.gather(
            *(self._on(node, self._start(node), self.beat_call_s) for node in self.shards), return_exceptions=True
        )
        if all(isinstance(r, BaseException) for r in results):
            raise next(r for r in results if isinstance(r, BaseException))

    async def stop(self) -> None:
        await cancel_and_wait(self._rejoin)
        await super().stop()

    async def check(self) -> bool:
        """The shards' check, after reading the map again when a node failed since the
        last one (a failover) or said ``MOVED``; False when the map changed."""
        await self.mapped()
        if self.stalled or self._unstarted:
            with contextlib.suppress(*self.errors):
                await self.remap()
        intact = await super().check()
        changed, self._changed = self._changed, False
        return intact and not changed


for _name in (
    "join",
    "leave",
    "publish",
    "history",
    "history_page",
    "reseed",
    "acquire",
    "renew",
    "release",
    "put_presence",
    "read_presence",
    "put_probe",
    "drop_probe",
    "cluster_probes",
    "take_tokens",
    "publish_once",
    "claim_once",
    "keep_once",
    "renew_once",
):
    setattr(ClusterBackplane, _name, _routed(getattr(ShardedBackplane, _name)))
del _name
