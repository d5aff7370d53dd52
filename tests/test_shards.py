"""The backplane over three Redis servers (private ones, started here) and two daphne
processes: channels spread over the shards, and losing one shard stops its channels only.

docs/capacity.md describes the rule (each channel's keys on the shard channels-redis'
hash picks; the cluster's own state on the first, the home shard).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
import redis

from realtime_app.cluster.shards import shard_of
from realtime_app.wire.names import group_name
from tests.support.cluster import Reader, publish_from_a_command
from tests.support.private_redis import PrivateRedis
from tests.support.servers import free_port, servers
from tests.support.waiting import eventually
from tests.support.wsclient import RPC

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

PREFIX = "shards"
SHARDS = 3


def test_a_channel_lives_where_channels_redis_would_put_it():
    """The rule is channels-redis' own (its private ``_consistent_hash``, pinned here: the
    code keeps a copy, so that the shard of a channel never depends on another package's
    private name)."""
    from channels_redis.utils import _consistent_hash

    names = [f"demo:clock:{ms}" for ms in range(100, 5000, 7)] + [f"room:{i}" for i in range(500)]
    for shards in (1, 2, 3, 5, 8):
        assert [shard_of(n, shards) for n in names] == [_consistent_hash(group_name(n), shards) for n in names]
        assert set(shard_of(n, shards) for n in names) == set(range(shards))  # every shard gets some


@pytest.mark.parametrize(
    "hosts",
    [
        None,
        [],
        ["redis://a:6379/0", "rediss://:pw@b:6380/2"],
        [("a", 6379), ["b", 6380]],
        [{"address": "redis://a:6379/0", "db": 1}, {"host": "c", "port": 1}],
        [{"master_name": "m", "sentinels": [("s", 26379)], "sentinel_kwargs": {"password": "x"}}],
    ],
)
def test_hosts_are_read_as_channels_redis_reads_them(hosts):
    """The backplane's copy of the host rule (realtime_app.cluster.hosts: channels_redis.utils
    is not a documented API) gives what the library's gives, on every shape."""
    from channels_redis.utils import decode_hosts as theirs

    from realtime_app.cluster.hosts import decode_hosts

    assert decode_hosts(hosts) == theirs(hosts)
    with pytest.raises(ValueError, match="list of Redis hosts"):
        decode_hosts("redis://a:6379/0")


def test_a_sentinel_host_makes_a_pool_of_its_masters_connections():
    from redis.asyncio.sentinel import SentinelConnectionPool

    from realtime_app.cluster.hosts import sentinel_pool

    host = {"master_name": "m", "sentinels": [("127.0.0.1", 1)], "sentinel_kwargs": {"socket_timeout": 1}, "db": 2}
    pool = sentinel_pool(host)
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "m"
    assert pool.connection_kwargs["db"] == 2 and host["master_name"] == "m"  # the settings untouched


def cluster_bus_free(port: int) -> bool:
    import socket

    if port + 10000 > 65535:
        return False
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port + 10000))
        except OSError:
            return False
    return True


async def test_a_redis_cluster_node_is_refused_with_a_clear_message(tmp_path):
    """A Redis Cluster node named as a plain server (REDIS_URL, REDIS_SHARDS) is an outage
    that says what to set instead: REDIS_CLUSTER (docs/redis-cluster.md)."""
    from realtime_app.cluster.redis import ClusterModeRefused, RedisBackplane

    node = PrivateRedis("--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf"))
    while not cluster_bus_free(node.port):  # a node also listens on its port + 10000
        node.port = free_port()
    node.start()
    backplane = RedisBackplane(config={"REDIS_URL": node.url, "KEY_PREFIX": PREFIX})
    try:
        with pytest.raises(ClusterModeRefused, match="Redis Cluster node: set REALTIME_APP\\['REDIS_CLUSTER'\\]"):
            await backplane.check()
        assert isinstance(ClusterModeRefused("x"), backplane.errors)  # down, logged once: not a crash
    finally:
        await backplane.stop()
        node.close()


def per_shard(candidates: list[str]) -> list[str]:
    """One channel of ``candidates`` on each shard, in shard order."""
    chosen = {}
    for name in candidates:
        chosen.setdefault(shard_of(name, SHARDS), name)
    assert sorted(chosen) == list(range(SHARDS)), chosen
    return [chosen[i] for i in range(SHARDS)]


CLOCKS = per_shard([f"demo:clock:{ms}" for ms in range(200, 1000, 50)])
KEPT = per_shard([f"test:kept-{n}" for n in range(24)])


@pytest.fixture
def shards():
    started = [PrivateRedis().start() for _ in range(SHARDS)]
    yield started
    for server in started:
        server.close()


def env_for(shards: list[PrivateRedis], layer: str) -> dict[str, str]:
    return {
        "REALTIME_CHANNEL_LAYER": layer,
        "REDIS_URL": ",".join(s.url for s in shards),
        "REALTIME_KEY_PREFIX": PREFIX,
        "REALTIME_LEASE_TTL_MS": "1500",
    }


@pytest.mark.parametrize(
    ("killed", "layer", "fault"), [(2, "core", "kill"), (0, "pubsub", "kill"), (1, "core", "pause")]
)
async def test_channels_spread_over_three_shards_and_losing_one_stops_only_its_channels(shards, killed, layer, fault):
    """``kill``: the server is gone (connections refused) and comes back empty; ``pause``:
    it hangs (SIGSTOP: calls time out) and comes back with its data."""
    env = env_for(shards, layer)
    clients = [s.client() for s in shards]
    with servers(2, env) as (a, b):
        async with Reader(a.ws, CLOCKS + KEPT) as ra, Reader(b.ws, CLOCKS + KEPT) as rb:
            await eventually(lambda: all(ra.seqs(c) and rb.seqs(c) for c in CLOCKS), 15, "every cadence ticking")
            for i, (clock, kept) in enumerate(zip(CLOCKS, KEPT, strict=True)):
                seq = await publish_from_a_command(env, kept, {"shard": i})
                await eventually(lambda k=kept, s=seq: s in ra.seqs(k) and s in rb.seqs(k), 10, f"{kept} on both")
                keys = {
                    "seq": f"{PREFIX}:seq:{group_name(clock)}",
                    "lease": f"{PREFIX}:lease:{group_name(clock)}",
                    "history": f"{PREFIX}:history:{group_name(kept)}",
                }
                for name, key in keys.items():  # on its own shard, and on no other
                    assert [bool(c.exists(key)) for c in clients] == [j == i for j in range(SHARDS)], (name, key)
            for clock in CLOCKS:  # one ticker per cadence: each seq once, the same on both processes
                common = sorted(set(ra.seqs(clock)) & set(rb.seqs(clock)))
                assert len(common) >= 2 and ra.seqs(clock) == sorted(set(ra.seqs(clock)))
            assert clients[0].zcard(f"{PREFIX}:instances") == 2  # the cluster's own state: the home shard

            # history and resume: published while a client was away, replayed by its resume
            kept = KEPT[(killed + 1) % SHARDS]
            position = ra.positions[kept]
            first = await publish_from_a_command(env, kept, {"n": 1})
            await publish_from_a_command(env, kept, {"n": 2})
            async with RPC(b.ws) as late:
                since = {"epoch": position["epoch"], "seq": first - 1}
                answer = (await late.call("subscribe", {"channel": kept, "since": since}))["result"]
                assert answer["recovered"] is True and answer["replayed"] == 2

            # one shard lost: its channels stop, the others' go on
            lost_clock, lost_kept = CLOCKS[killed], KEPT[killed]
            old_epoch = ra.positions[lost_kept]["epoch"]
            getattr(shards[killed], fault)()
            down = time.monotonic()
            others = [c for i, c in enumerate(CLOCKS) if i != killed]
            await eventually(  # past several lease TTLs: their leases are renewed meanwhile
                lambda: all(ra.has_frame_after(c, down + 6) and rb.has_frame_after(c, down + 6) for c in others),
                20,
                "the other shards' channels going on",
            )
            assert not ra.has_frame_after(lost_clock, down + 1) and not rb.has_frame_after(lost_clock, down + 1)
            healthy_kept = KEPT[(killed + 1) % SHARDS]
            seq = await publish_from_a_command(env, healthy_kept, {"during": True})
            await eventually(lambda: seq in ra.seqs(healthy_kept) and seq in rb.seqs(healthy_kept), 10, "published")
            async with RPC(a.ws) as during:  # a call on the lost shard's channel is refused, to come back
                since = {"epoch": old_epoch, "seq": 1}
                refused = await during.call("subscribe", {"channel": lost_kept, "since": since}, timeout=15)
                assert refused.get("error", {}).get("code") == -32003, refused
                assert refused["error"]["data"]["reason"] == "backplane_unavailable", refused
                if killed == 0:  # the shared buckets lived on the home shard: this process's own bucket
                    echoed = await during.call("demo.echo", {"text": "x"}, timeout=15)
                    assert "result" in echoed, echoed

            if fault == "kill":
                shards[killed].start()  # back, empty
            else:
                shards[killed].resume()  # back, with its data
            back = time.monotonic()
            await eventually(
                lambda: ra.has_frame_after(lost_clock, back) and rb.has_frame_after(lost_clock, back),
                20,
                "its channels by themselves",
            )
            seq = await publish_from_a_command(env, lost_kept, {"after": True})
            await eventually(lambda: seq in ra.seqs(lost_kept) and seq in rb.seqs(lost_kept), 10, "kept again")
            async with RPC(a.ws) as resuming:  # the epoch says what was lost, if anything
                since = {"epoch": old_epoch, "seq": 1}
                answer = (await resuming.call("subscribe", {"channel": lost_kept, "since": since}))["result"]
                if fault == "kill":
                    assert answer["recovered"] is False and answer["epoch"] != old_epoch
                else:
                    assert answer["recovered"] is True and answer["epoch"] == old_epoch
            if killed != 0:  # the home shard's probes say which shard was down
                probes = [json.loads(p) for p in clients[0].mget(clients[0].keys(f"{PREFIX}:probe:*"))]
                assert all(p["backplane"]["shards"][killed]["outages"] >= 1 for p in probes)
                assert all(len(p["backplane"]["shards"]) == SHARDS for p in probes)


async def test_a_shard_down_at_start_is_started_by_a_later_check_and_nothing_is_left_open():
    """The process starts on the shards that answer; the other one starts at the first
    check after it comes back; until then its channels' calls are refused at once."""
    from realtime_app.cluster.shards import ShardedBackplane, ShardUnavailable

    servers = [PrivateRedis().start(), PrivateRedis().start()]
    servers[1].kill()
    channel = next(f"room:{i}" for i in range(100) if shard_of(f"room:{i}", 2) == 1)
    config = {"REDIS_SHARDS": [s.url for s in servers], "KEY_PREFIX": PREFIX, "LEASE_TTL_MS": 1500}
    backplane = ShardedBackplane(instance_id="start-test", config=config)
    delivered = []

    async def deliver(delivery):
        delivered.append(delivery)

    def receivers() -> int:
        return sum(1 for t in asyncio.all_tasks() if t.get_name() == "realtime-receive" and not t.done())

    try:
        await backplane.start(deliver)  # one shard of two: started
        assert receivers() == 1 and backplane.outage.down
        await backplane.check()  # the first: the answering shard's state is new
        assert await backplane.check() is True  # the answering shard is intact; the other is down
        started = time.monotonic()
        with pytest.raises(ShardUnavailable):
            await backplane.publish(channel, "{}")
        assert time.monotonic() - started < 0.5  # refused at once, not after a timeout
        servers[1].start()
        assert await backplane.check() is False  # back: the hub re-asserts
        assert receivers() == 2
        await backplane.join([channel])
        seq = await backplane.publish(channel, '{"n":1}')
        await eventually(lambda: any(d.seq == seq for d in delivered), 5, "the frame through the late shard")
    finally:
        await backplane.stop()
        for server in servers:
            server.close()
    assert receivers() == 0


async def test_a_sentinel_service_is_a_shard(tmp_path):
    """A shard given as a Sentinel service (channels-redis' host dict): the backplane finds
    the master through its sentinel, with the backplane's own bounds on every connection."""
    import subprocess

    from realtime_app.cluster.shards import ShardedBackplane
    from tests.support.private_redis import redis_binary

    master, other = PrivateRedis().start(), PrivateRedis().start()
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\nsentinel monitor svc 127.0.0.1 {master.port} 1\n")
    sentinel = await asyncio.create_subprocess_exec(
        redis_binary(), str(conf), "--sentinel", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    host = {"sentinels": [("127.0.0.1", port)], "master_name": "svc"}
    config = {"REDIS_SHARDS": [other.url, host], "KEY_PREFIX": PREFIX, "REDIS_TIMEOUT_MS": 700}
    backplane = ShardedBackplane(instance_id="sentinel-test", config=config)
    channel = next(f"room:{i}" for i in range(100) if shard_of(f"room:{i}", 2) == 1)
    try:

        async def up() -> bool:
            try:
                return await backplane.shards[1].check() in (True, False)
            except backplane.errors:
                return False

        await eventually(up, 15, "the sentinel answering")
        kwargs = backplane.shards[1].redis.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.7
        seq = await backplane.publish(channel, "{}")
        assert master.client().get(f"{PREFIX}:seq:{group_name(channel)}") == str(seq)  # on the master
        assert backplane.shards_probe()[1]["address"] == "sentinel:svc"
        await backplane.stop()
        with pytest.raises(backplane.errors):  # a call after the stop (a task that outlived it)
            await backplane.publish(channel, "{}")

        def sentinel_clients() -> int:  # but the one asking
            client = redis.Redis(port=port, socket_timeout=5)
            try:
                return int(client.info("clients")["connected_clients"]) - 1
            finally:
                client.close()

        # Found: the sentinels' own connections were not gated; a late call's lookup of the
        # master opened one, in a client nothing closed again.
        await eventually(lambda: sentinel_clients() == 0, 10, "no connection to the sentinel left")
    finally:
        await backplane.stop()
        sentinel.terminate()
        await asyncio.wait_for(sentinel.wait(), 10)
        master.close()
        other.close()


def test_every_shape_of_host_gets_the_backplanes_bounds():
    """A host as a URL, as host and port (channels-redis' ``(host, port)``): the pool waits
    for a connection at most ``REDIS_TIMEOUT_MS`` and holds ``REDIS_MAX_CONNECTIONS``."""
    from redis.asyncio import BlockingConnectionPool

    from realtime_app.cluster.redis import RedisBackplane

    config = {"REDIS_TIMEOUT_MS": 700, "REDIS_MAX_CONNECTIONS": 7}
    for host in ({"address": "redis://127.0.0.1:1/0"}, {"host": "127.0.0.1", "port": 1}):
        pool = RedisBackplane(config=config, hosts=[host]).redis.connection_pool
        assert isinstance(pool, BlockingConnectionPool) and pool.max_connections == 7 and pool.timeout == 0.7
        assert pool.connection_kwargs["socket_timeout"] == 0.7


def test_realtime_probe_names_the_shards_that_are_down():
    from realtime_app.management.commands.realtime_probe import table

    shards = [{"index": 0, "address": "a:6379/0", "up": True, "outages": 0}]
    shards.append({"index": 1, "address": "b:6379/0", "up": False, "outages": 1})
    text = table({"instances": [{"instance": "p1", "backplane": {"up": False, "outages": 1, "shards": shards}}]})
    assert "down: shard 1" in text
    shards[1]["up"] = True
    assert "down" not in table({"instances": [{"instance": "p1", "backplane": {"up": True, "shards": shards}}]})


def test_an_app_fed_value_lives_on_the_shard_of_its_channel():
    from realtime_app.declarations.registry import fed_channel

    for n in range(50):
        assert shard_of(fed_channel(f"lot:{n}"), 4) == shard_of(f"lot:{n}", 4)


async def test_a_call_on_a_shard_stopped_meanwhile_is_no_outage(caplog):
    """A call that picked its shard just before the shard was stopped (a Redis Cluster
    dropping a node from its map) is refused unsent, as :class:`ShardStopped`: the shard is
    not marked stalled for good nor logged unreachable (it was, once the stopped client
    refused to connect)."""
    from realtime_app.cluster.shards import ShardedBackplane

    servers = [PrivateRedis().start(), PrivateRedis().start()]
    backplane = ShardedBackplane(instance_id="stopped", config={"REDIS_SHARDS": [s.url for s in servers]})
    channel = next(f"room:{i}" for i in range(100) if shard_of(f"room:{i}", 2) == 1)
    try:
        shard = backplane.shards[1]
        await shard.stop()
        with caplog.at_level(logging.ERROR, logger="realtime_app"), pytest.raises(backplane.errors) as refused:
            await backplane.publish(channel, "{}")
        assert shard not in backplane.stalled and not shard.outage.down
        assert not [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert type(refused.value).__name__ == "ShardStopped"  # what a cluster makes again on its new map
        # Calls under way as their shard stops, cut at each step in turn: whatever each
        # hears, a shard that was stopped is never left stalled (the beat would read a
        # cluster's map again on every beat for a node that is gone).
        for steps in range(8):
            again = ShardedBackplane(instance_id=f"stopped-{steps}", config={"REDIS_SHARDS": [s.url for s in servers]})
            calls = [asyncio.get_running_loop().create_task(again.publish(channel, "{}")) for _ in range(3)]
            for _ in range(steps):
                await asyncio.sleep(0)
            await again.shards[1].stop()
            await asyncio.gather(*calls, return_exceptions=True)
            assert again.shards[1] not in again.stalled, f"stalled by calls cut {steps} steps in"
            await again.stop()
    finally:
        await backplane.stop()
        for server in servers:
            server.close()
