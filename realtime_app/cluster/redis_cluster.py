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
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from redis.crc import key_slot
from redis.exceptions import AskError, ClusterCrossSlotError, TryAgainError

from realtime_app.cancellation import cancel_and_wait, uninterrupted
from realtime_app.cluster.hosts import close_client, redis_client
from realtime_app.cluster.redis import RedisBackplane
from realtime_app.cluster.redis_scripts import for_cluster
from realtime_app.cluster.shards import ShardedBackplane, ShardStopped, ShardUnavailable
from realtime_app.declarations.registry import FED_PREFIX
from realtime_app.wire.names import group_name

__all__ = ["ClusterBackplane", "ClusterNode", "Topology", "parse_shards", "tag_of"]

logger = logging.getLogger("realtime_app.backplane")

T = TypeVar("T")
P = ParamSpec("P")
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

    @property
    def complete(self) -> bool:
        """Every slot has a master."""
        return "" not in self._owner

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
    presence_liveness = False  # its scripts reach one slot's keys: parts renewed every beat

    def _held_names(self) -> Any:
        return self._pubsub.shard_channels if self._pubsub is not None else {}

    def __init__(
        self,
        *,
        instance_id: str,
        config: dict[str, Any] | None,
        url: str,
        ranges: list[tuple[int, int]],
        owner: ClusterBackplane,
    ) -> None:
        super().__init__(instance_id=instance_id, config=config, hosts=[{"address": url}])
        self.refuse_cluster = False
        self.url = url
        self.ranges = ranges
        self.node_tag = _tag_within(ranges, f"{self.prefix}-node")
        self.owner = owner
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

    def _forget(self, names: list[bytes]) -> list[str]:
        """Drop ``names`` from what this node carries, and from what redis-py would subscribe
        again on a reconnect (all at once: across slots, refused); their channels."""
        remembered = getattr(self._pubsub, "shard_channels", {})
        for name in names:
            remembered.pop(name, None)
        return [channel for name in names if (channel := self._names.pop(name, None)) is not None]

    def dropped(self, name: bytes) -> None:
        """The master unsubscribed this process (the slot moved): joined again on its owner."""
        self.owner.rejoin(self._forget([name]))

    def refused(self, exc: BaseException) -> bool:
        """A subscription refused by this node — its slot is elsewhere (``MOVED``: a join on
        a map out of date), or redis-py resubscribed every channel in one command after a
        reconnect (across slots: refused) — is joined again where it belongs. Not an
        outage: the node answered."""
        if isinstance(exc, AskError):  # the channels of that slot only
            self.owner.rejoin(self._forget([n for n in self._names if key_slot(n) == exc.slot_id]))
            return True
        if isinstance(exc, ClusterCrossSlotError):  # redis-py resubscribed them all in one command
            self.owner.rejoin(self._forget(list(self._names)))
            return True
        return False


def _routed(
    method: Callable[Concatenate[Any, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]:
    """A backplane call on the cluster: the map read first if it never was; made once more
    when it was refused before anything ran — ``MOVED``/``ASK`` (after reading the map), or
    a node known to be down whose slots the map read again gives to another (a failover: a
    publisher follows it without waiting for the beat). An error after the command may have
    run (a connection lost meanwhile) is not retried: it could run twice."""

    async def routed(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> T:
        await self.mapped()
        try:
            return await method(self, *args, **kwargs)
        except AskError:  # MOVED (a subclass), or ASK while a slot migrates
            await self.remap()
        except ShardStopped:  # its node dropped from the map meanwhile, never sent: on the new map
            pass
        except ShardUnavailable:  # refused here, never sent
            if not await self.remap_soon():
                raise
        return await method(self, *args, **kwargs)

    routed.__name__, routed.__doc__ = method.__name__, method.__doc__
    return routed


class ClusterBackplane(ShardedBackplane):
    """A :class:`ClusterNode` per master of the cluster, each channel on the master of its
    slot (see the module's docstring)."""

    #: Redirections and a retry asked for while a slot migrates: the node answered.
    not_outages = (AskError, TryAgainError)

    # Every call: on the map (read first if it never was), redirections followed.
    publish = _routed(ShardedBackplane.publish)
    history = _routed(ShardedBackplane.history)
    history_page = _routed(ShardedBackplane.history_page)
    reseed = _routed(ShardedBackplane.reseed)
    acquire = _routed(ShardedBackplane.acquire)
    renew = _routed(ShardedBackplane.renew)
    release = _routed(ShardedBackplane.release)
    put_presence = _routed(ShardedBackplane.put_presence)
    read_presence = _routed(ShardedBackplane.read_presence)
    put_probe = _routed(ShardedBackplane.put_probe)
    drop_probe = _routed(ShardedBackplane.drop_probe)
    cluster_probes = _routed(ShardedBackplane.cluster_probes)
    take_tokens = _routed(ShardedBackplane.take_tokens)
    publish_once = _routed(ShardedBackplane.publish_once)
    claim_once = _routed(ShardedBackplane.claim_once)
    keep_once = _routed(ShardedBackplane.keep_once)
    renew_once = _routed(ShardedBackplane.renew_once)
    _join = _routed(ShardedBackplane.join)
    _leave = _routed(ShardedBackplane.leave)

    def __init__(self, *, instance_id: str = "headless", config: dict[str, Any] | None = None) -> None:
        super().__init__(instance_id=instance_id, config=config, hosts=[])
        from realtime_app.conf import with_defaults

        self.settings = with_defaults(config)
        self.startup: list[str] = list(self.settings["REDIS_CLUSTER"] or [])
        self.topology: Topology | None = None
        self.nodes: dict[str, ClusterNode] = {}  # by "host:port"
        self._changed = False  # the map changed since the last check: the hub re-asserts
        self._remapping: asyncio.Task[bool] | None = None
        self._remapped_at = float("-inf")
        self._wanted: set[str] = set()  # the channels joined and not left
        self._dropped: set[str] = set()
        self._rejoining: asyncio.Task[None] | None = None
        self._stopped = False

    # -- the map -------------------------------------------------------------------------

    def shard(self, channel: str) -> RedisBackplane:
        assert self.topology is not None
        node = self.nodes.get(self.topology.owner(slot_of(tag_of(channel))))
        if node is None:
            raise ShardUnavailable(f"no master of the Redis Cluster serves the slot of {channel!r} now")
        return node

    async def mapped(self) -> None:
        if self.topology is None:
            await self.remap()

    async def remap(self) -> bool:
        """Read the slots again and carry every master; True when the map changed. One
        reading at a time, in a task of this backplane's: a caller that gives up (the
        beat's bound, a cancelled request) leaves it to finish, never half-adopted."""
        self._remapped_at = asyncio.get_running_loop().time()
        if self._remapping is None or self._remapping.done():
            self._remapping = asyncio.get_running_loop().create_task(self._remap(), name="realtime-cluster-map")
            self._remapping.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(self._remapping)

    async def remap_soon(self) -> bool:
        """:meth:`remap` unless one was tried in the last :data:`REMAP_EVERY_S` (a node that
        is down fails many calls at once); True when the map changed."""
        if asyncio.get_running_loop().time() - self._remapped_at < REMAP_EVERY_S:
            return False
        try:
            return await self.remap()
        except self.errors:
            return False

    async def _remap(self) -> bool:
        topology = await self._read()
        if topology == self.topology or self._stopped:
            return False
        await self._adopt(topology)
        return True

    async def _read(self) -> Topology:
        """``CLUSTER SHARDS`` from the first node to answer, all asked at once — the masters
        that answer, the startup nodes, the masters that do not — each within a bound below
        the beat's, so that one that hangs delays nothing."""
        stalled = [node.url for node in self.nodes.values() if node in self.stalled]
        urls = [node.url for node in self.nodes.values() if node.url not in stalled]
        urls += [url for url in [*self.startup, *stalled] if url not in urls]
        bound = min(self.settings["REDIS_TIMEOUT_MS"] / 1000, max(self.beat_call_s, 0.5))
        asks = [asyncio.get_running_loop().create_task(self._ask(url, bound)) for url in dict.fromkeys(urls)]
        failure: BaseException | None = None
        unanswered: tuple[type[BaseException], ...] = (*self.errors, ValueError)
        try:
            for done in asyncio.as_completed(asks):
                try:
                    topology = await done
                except unanswered as exc:
                    failure = exc
                    continue
                if topology.masters:
                    return topology
        finally:  # every ask ended here, even when this reading is cancelled meanwhile
            await uninterrupted(cancel_and_wait(*asks))
        raise ConnectionError(f"no node of REDIS_CLUSTER answered CLUSTER SHARDS ({failure})")

    async def _ask(self, url: str, bound: float) -> Topology:
        client = redis_client({**self.settings, "REDIS_TIMEOUT_MS": int(bound * 1000)}, {"address": url})
        try:
            async with asyncio.timeout(bound):
                return parse_shards(await client.execute_command("CLUSTER SHARDS"))
        finally:
            with contextlib.suppress(Exception):  # (closed whole when this ask is cancelled)
                await close_client(client)

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
                    owner=self,
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
        dropped = [self.nodes.pop(a) for a in list(self.nodes) if a not in topology.masters]
        self.stalled.difference_update(dropped)
        self._unstarted.difference_update(dropped)
        self.shards[:] = list(self.nodes.values())  # the outage's view too
        self.topology = topology
        home = self.nodes.get(topology.owner(slot_of(HOME_TAG)))
        self.home = home if home is not None else next(iter(self.nodes.values()))  # (calls there say why)
        # Stopped once the new map is in place: a call refused by one of them (ShardStopped) is
        # made again on the new map; all of them, even when this reading is cancelled meanwhile.
        await uninterrupted(asyncio.gather(*(node.stop() for node in dropped), return_exceptions=True))
        if not first:
            self._changed = True
            logger.warning(
                "the Redis Cluster's map changed: masters %s; re-asserting what this process holds",
                ", ".join(sorted(topology.masters)),
            )

    def _url_of(self, address: str) -> str:
        """A master's URL: the startup URL's scheme, credentials and options on its address."""
        from urllib.parse import urlsplit, urlunsplit

        template = urlsplit(self.startup[0])
        credentials = template.netloc.rpartition("@")[0]
        netloc = f"{credentials}@{address}" if credentials else address
        return urlunsplit((template.scheme, netloc, "/0", template.query, ""))

    # -- subscriptions a node lost -------------------------------------------------------

    async def join(self, channels: list[str]) -> None:
        self._wanted.update(channels)
        await self._join(channels)

    async def leave(self, channel: str) -> None:
        self._wanted.discard(channel)
        self._dropped.discard(channel)
        await self._leave(channel)

    def rejoin(self, channels: list[str]) -> None:
        """Join ``channels`` again where the map says, now (a node lost their subscriptions)."""
        self._dropped.update(c for c in channels if c in self._wanted)
        if self._dropped and not self._stopped and (self._rejoining is None or self._rejoining.done()):
            self._rejoining = asyncio.get_running_loop().create_task(self._rejoin(), name="realtime-cluster-rejoin")

    async def _rejoin(self) -> None:
        for attempt in range(20):  # the cluster's gossip may lag a failover for a moment
            channels = sorted(self._dropped & self._wanted)
            self._dropped.clear()
            if not channels or self._stopped:
                return
            try:
                await self.remap_soon()
                await self._join(channels)
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
        await uninterrupted(self._stop())  # (as each node's: once begun, to the end)

    async def _stop(self) -> None:
        self._stopped, self._deliver = True, None  # nothing started or rejoined from here
        await cancel_and_wait(self._rejoining)
        await cancel_and_wait(self._remapping)
        # Every node, one adopted mid-way by a cancelled reading included.
        every: list[RedisBackplane] = [*self.shards, *self.nodes.values()]
        self.shards[:] = list(dict.fromkeys(every))
        await super().stop()

    async def check(self) -> bool:
        """The shards' check, after reading the map again when a node failed since the
        last one (a failover), or a slot had no master; False when the map changed."""
        await self.mapped()
        assert self.topology is not None
        if self.stalled or self._unstarted or not self.topology.complete:
            with contextlib.suppress(*self.errors):
                await self.remap()
        intact = await super().check()
        changed, self._changed = self._changed, False
        return intact and not changed
