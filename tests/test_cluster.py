"""Two daphne processes sharing the real Redis, on each of channels-redis' layers: one
ticker per cadence in the cluster, per-process fan-out, a publication from a management
command, cleanup, and failover when the ticker's process is killed."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time

import pytest
import redis

from realtime_app.wire.names import group_name
from tests.support.cluster import publish_from_a_command
from tests.support.servers import servers
from tests.support.waiting import eventually
from tests.support.wsclient import RPC

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

LEASE_TTL_MS = 1500


@pytest.fixture(params=["core", "pubsub"])
def cluster(redis_url, request):
    """Two daphne processes of the demo site on Redis, with a key prefix of their own, on
    each of channels-redis' layers (``RedisChannelLayer``, ``RedisPubSubChannelLayer``)."""
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-{secrets.token_hex(3)}"
    env = {
        "REDIS_URL": redis_url,
        "REALTIME_KEY_PREFIX": prefix,
        "REALTIME_LEASE_TTL_MS": str(LEASE_TTL_MS),
        "REALTIME_CHANNEL_LAYER": request.param,
    }
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with servers(2, env) as procs:
        yield procs, client, prefix, env
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)


def events(client, prefix):
    return [tuple(json.loads(e)[:2]) for e in client.lrange(f"{prefix}:test-events", 0, -1)]


def instance_pids(client: redis.Redis, prefix: str) -> dict[str, int]:
    """Each live process's instance id and pid, from the probes it keeps in Redis."""
    ids = list(client.zrange(f"{prefix}:instances", 0, -1))  # the fixture's client decodes
    probes = [client.get(f"{prefix}:probe:{i}") for i in ids]
    return {i: json.loads(raw)["pid"] for i, raw in zip(ids, probes, strict=True) if raw}


def tick_gap(frames: list[dict]) -> float:
    """The mean time between a channel's ticks: its frames, any repeat of the frame before
    (the same data) left out."""
    ticks = [f for i, f in enumerate(frames) if i == 0 or f["data"] != frames[i - 1]["data"]]
    assert len(ticks) >= 2, frames
    return (ticks[-1]["ts"] - ticks[0]["ts"]) / (len(ticks) - 1)


async def test_two_processes_share_one_ticker_per_cadence(cluster):
    (a, b), client, prefix, _ = cluster
    async with RPC(a.ws) as ca, RPC(b.ws) as cb, RPC(b.ws) as c4:
        await ca.subscribe("demo:clock:2000")
        await cb.subscribe("demo:clock:2000")
        await c4.subscribe("demo:clock:4000")
        fa, fb = await asyncio.gather(ca.frames(3), cb.frames(3))
        sa, sb = [f["seq"] for f in fa], [f["seq"] for f in fb]
        common = sorted(set(sa) & set(sb))
        assert len(common) >= 2, (sa, sb)  # the same publications reach both processes
        assert sa == sorted(set(sa)) and sb == sorted(set(sb))  # no duplicates, in order
        assert all({f["seq"]: f["data"] for f in fa}[s] == {f["seq"]: f["data"] for f in fb}[s] for s in common)
        # one tick per 2 s, not two: two tickers would halve the gap between ticks
        assert tick_gap(fa) >= 1500, [(f["seq"], f["ts"], f["data"]) for f in fa]
        # one lease per cadence: :2000's held by one of the two, :4000's by b, its only subscriber
        instance = {pid: instance for instance, pid in instance_pids(client, prefix).items()}
        assert set(instance) == {a.process.pid, b.process.pid}
        holder_2000 = client.get(f"{prefix}:lease:{group_name('demo:clock:2000')}")
        holder_4000 = client.get(f"{prefix}:lease:{group_name('demo:clock:4000')}")
        assert holder_2000 in instance.values()
        assert holder_4000 == instance[b.process.pid]
        f4 = await c4.frames(3)
        assert tick_gap(f4) >= 3000, f4


async def test_factory_runs_once_in_the_cluster_and_is_cleaned_after_the_last(cluster):
    (a, b), client, prefix, _ = cluster
    channel = "test:counter:300"
    ca = await RPC(a.ws).__aenter__()
    cb = await RPC(b.ws).__aenter__()
    await ca.subscribe(channel)
    await cb.subscribe(channel)
    await asyncio.gather(ca.frames(3), cb.frames(3))
    assert events(client, prefix).count(("start", channel)) == 1
    # the first process leaves by unsubscribing; the ticker stays (or moves) for the other
    await ca.call("unsubscribe", {"channel": channel})
    await cb.frames(3)
    starts_and_cleanups = events(client, prefix)
    assert starts_and_cleanups.count(("start", channel)) - starts_and_cleanups.count(("cleanup", channel)) == 1
    # the last subscriber disconnects without unsubscribing: cleanup runs, the lease goes
    await cb.__aexit__(None, None, None)
    await ca.__aexit__(None, None, None)
    lease = f"{prefix}:lease:{group_name(channel)}"
    await eventually(lambda: client.get(lease) is None)
    final = events(client, prefix)
    assert final.count(("start", channel)) == final.count(("cleanup", channel)) >= 1


async def test_killing_the_ticker_process_fails_over_without_duplicates(cluster):
    (a, b), client, prefix, _ = cluster
    channel = "demo:clock:200"
    async with RPC(a.ws) as ca:
        await ca.subscribe(channel)
        await ca.frames(2)
        cb = await RPC(b.ws).__aenter__()
        await cb.subscribe(channel)
        await cb.frames(2)
        holder = client.get(f"{prefix}:lease:{group_name(channel)}")
        victim, survivor, survivor_client = (a, b, cb) if f"-{a.process.pid}-" in holder else (b, a, ca)
        if survivor_client is ca:
            await cb.__aexit__(None, None, None)
        before = await survivor_client.frames(2)
        killed_at = time.time() * 1000
        victim.kill()
        after = await survivor_client.frames(5, timeout=LEASE_TTL_MS / 1000 * 3 + 5)
        seqs = [f["seq"] for f in before + after]
        assert seqs == sorted(set(seqs)), seqs  # no seq delivered twice, never backwards
        resumed = [f for f in after if f["ts"] > killed_at]
        assert resumed, after
        # failover within seconds (lease TTL plus a beat; slack for a loaded machine), not minutes
        assert resumed[0]["ts"] - killed_at <= 2 * LEASE_TTL_MS + 3000
        new_holder = client.get(f"{prefix}:lease:{group_name(channel)}")
        assert new_holder and f"-{survivor.process.pid}-" in new_holder
        if survivor_client is cb:
            await cb.__aexit__(None, None, None)


async def test_a_dead_process_leaves_the_cluster_view(cluster, redis_url):
    (a, b), client, prefix, _ = cluster
    async with RPC(a.ws), RPC(b.ws):
        instances = f"{prefix}:instances"
        await eventually(lambda: len(client.zrangebyscore(instances, time.time() * 1000, "+inf")) == 2)
        b.kill()
        await eventually(lambda: len(client.zrangebyscore(instances, time.time() * 1000, "+inf")) == 1, timeout=15)


async def test_publish_from_another_process_reaches_both_servers(cluster):
    (a, b), client, prefix, env = cluster
    async with RPC(a.ws) as ca, RPC(b.ws) as cb:
        await ca.subscribe("demo:events")
        await cb.subscribe("demo:events")
        seq = await publish_from_a_command(env, "demo:events", {"from": "shell"})
        fa, fb = await asyncio.gather(ca.frames(1), cb.frames(1))
        assert fa == fb and fa[0]["seq"] == seq and fa[0]["data"] == {"from": "shell"}


async def test_the_applications_own_consumers_keep_working_beside_the_hub(cluster, redis_url):
    """channels-redis serves all process-local channels through one receive lock: the hub's
    channel must not starve the application's consumers (regression)."""
    from channels_redis.core import RedisChannelLayer
    from channels_redis.pubsub import RedisPubSubChannelLayer

    (a, _), _, prefix, env = cluster
    kind = RedisPubSubChannelLayer if env["REALTIME_CHANNEL_LAYER"] == "pubsub" else RedisChannelLayer
    layer = kind(hosts=[redis_url], prefix=f"{prefix}:asgi")
    plain_url = a.ws.replace("/realtime/", "/plain/")
    async with RPC(a.ws) as hub_client, RPC(plain_url) as plain:
        await hub_client.subscribe("demo:clock:100")  # the hub now receives on the layer too
        await hub_client.frames(2)
        for i in range(5):
            sent = time.monotonic()
            await layer.group_send("plain", {"type": "plain.message", "text": json.dumps({"i": i})})
            # starved, a message waits out channels-redis' 5 s blocking pop
            assert await plain.recv(timeout=4) == {"i": i}
            assert time.monotonic() - sent < 3.5
    await layer.flush()
