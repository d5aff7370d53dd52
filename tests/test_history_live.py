"""Event history and resume, live: daphne processes on Redis, a publisher process of the
cluster, clients that go away, get closed with 1013, drop frames, or resume while a
publisher runs at 1 kHz; and a Redis flush that ends a history (docs/recovery.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import sys
import time
from typing import Any

import pytest
import redis

from realtime_app.client import RealtimeClient
from tests.support.postgres import TcpProxy
from tests.support.private_redis import PrivateRedis
from tests.support.servers import ROOT, Server, servers
from tests.support.waiting import eventually
from tests.support.wsclient import RPC

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

CHANNEL = "demo:events"


def cluster_env(redis_url: str, **extra: str) -> tuple[dict[str, str], str]:
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-{secrets.token_hex(3)}"
    return {"REDIS_URL": redis_url, "REALTIME_KEY_PREFIX": prefix, "REALTIME_LEASE_TTL_MS": "1500", **extra}, prefix


@contextlib.contextmanager
def cluster(redis_url: str, count: int = 2, **extra: str):
    """``count`` daphne processes of the test site on Redis, with a key prefix of their own."""
    env, prefix = cluster_env(redis_url, **extra)
    client = redis.Redis.from_url(redis_url)
    try:
        with servers(count, env) as procs:
            yield procs, env
    finally:
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()


async def publish(env: dict[str, str], count: int, rate: float, channel: str = CHANNEL) -> tuple[int, int]:
    """Publish ``{"i": 0..count-1}`` from a process of its own; returns its first and last seq."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.support.publisher",
        channel,
        str(count),
        str(rate),
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await process.communicate()
    text = out.decode(errors="replace")
    assert process.returncode == 0, text
    done = [line for line in text.splitlines() if line.startswith("done ")]
    assert done, text
    first, last = done[-1].split()[1:]
    return int(first), int(last)


def drops(env: dict[str, str]) -> int:
    """Frames the guard dropped, from the processes' probes in Redis."""
    prefix = env["REALTIME_KEY_PREFIX"]
    client = redis.Redis.from_url(env["REDIS_URL"])
    try:
        ids = client.zrangebyscore(f"{prefix}:instances", time.time() * 1000, "+inf")
        raw = client.mget([f"{prefix}:probe:{i.decode()}" for i in ids]) if ids else []
    finally:
        client.close()
    return sum(json.loads(r)["backpressure"]["drops"] for r in raw if r)


class Collector:
    """A :class:`RealtimeClient` whose messages, resumes and resyncs are kept."""

    def __init__(self, url: str, origin: str, **options: Any) -> None:
        self.client = RealtimeClient(url, origin=origin, backoff_initial=0.2, backoff_max=0.5, **options)
        self.messages: list[dict[str, Any]] = []
        self.recovered: list[int] = []
        self.resyncs: list[dict[str, Any]] = []
        self.closes: list[int | None] = []
        self.client.on_recovered.append(lambda channel, n: self.recovered.append(n))
        self.client.on_resync.append(lambda channel, info: self.resyncs.append(info))
        self.client.on_close.append(lambda code, reason, again: self.closes.append(code))
        self.subscribe_errors: list[str] = []
        self.client.on_subscribe_error.append(lambda channel, error: self.subscribe_errors.append(str(error)))

    async def __aenter__(self) -> Collector:
        await self.client.connect()
        await self.client.subscribe(CHANNEL, self.messages.append)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()

    def items(self) -> list[int]:
        return [m["data"]["i"] for m in self.messages]

    def assert_in_order_once(self) -> None:
        seqs = [m["seq"] for m in self.messages]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        assert len({m["epoch"] for m in self.messages}) == 1


@pytest.mark.parametrize("layer", ["core", "pubsub"])
async def test_a_client_away_for_5_s_gets_the_100_events_it_missed_in_order_once_then_live(redis_url, layer):
    with cluster(redis_url, REALTIME_CHANNEL_LAYER=layer) as ((a, _b), env):
        proxy = TcpProxy(a.port).restore()
        try:
            async with Collector(f"ws://127.0.0.1:{proxy.port}/realtime/", a.http) as c:
                await publish(env, 5, 0)
                await eventually(lambda: len(c.messages) == 5, 15, "the first 5 events")
                proxy.cut()  # away: the connection drops, reconnecting fails
                away = time.monotonic()
                await publish(env, 100, 30)
                assert len(c.messages) == 5  # nothing reaches a client that is away
                await asyncio.sleep(max(0.0, 5 - (time.monotonic() - away)))  # the scenario: 5 s away
                proxy.restore()
                await eventually(lambda: len(c.messages) == 105, 20, "the 100 missed events")
                assert c.items() == list(range(5)) + list(range(100))
                assert c.recovered == [100] and c.resyncs == []
                await publish(env, 3, 0)  # then live
                await eventually(lambda: len(c.messages) == 108, 15, "live events after the resume")
                c.assert_in_order_once()
        finally:
            proxy.cut()


@pytest.mark.parametrize("policy", ["drop", "close"])
async def test_events_dropped_or_closed_1013_by_backpressure_are_all_recovered(redis_url, policy):
    """The flood setup of the backpressure tests (32 KiB frames every 10 ms, 1 MiB
    threshold) with events interleaved; the client stops reading for a while. ``drop``:
    frames are dropped and the client resumes by itself without reconnecting; ``close``:
    it is closed with 1013 and resumes when it reconnects."""
    extra = {
        "REALTIME_TEST_OVERRIDES": json.dumps({"PROBE_TTL_MS": 600}),
        "REALTIME_DEMO_FLOOD": "1",
        "REALTIME_MAX_BACKPRESSURE": str(1024 * 1024),
        "REALTIME_CLOSE_AFTER_DROPS": "100" if policy == "close" else "1000000",
    }
    with cluster(redis_url, 1, **extra) as ((a,), env):
        async with Collector(a.ws, a.http) as c:
            await c.client.subscribe("demo:flood:10", lambda params: None)
            publisher = asyncio.get_running_loop().create_task(publish(env, 100, 15))  # ~6.5 s
            await eventually(lambda: len(c.messages) >= 10, 15, "events before the stall")
            c.client.socket.ws.transport.pause_reading()  # a client that stops reading: TCP fills up
            if policy == "close":
                await eventually(lambda: "closed with 1013" in a.output(), 30, "the 1013 close")
            else:
                await eventually(lambda: drops(env) > 0, 30, "frames dropped by the guard")
                await asyncio.sleep(0.6)  # stay stalled while ~9 more events are published (and dropped)
            c.client.socket.ws.transport.resume_reading()
            await publisher
            await eventually(lambda: len(c.messages) == 100, 30, "every event")
            assert c.items() == list(range(100))
            c.assert_in_order_once()
            assert c.resyncs == [] and c.recovered, c.recovered
            if policy == "close":
                assert 1013 in c.closes
            else:
                assert c.closes == []  # recovered without reconnecting


async def test_a_since_older_than_the_history_is_not_recovered_and_the_last_1000_are(redis_url):
    with cluster(redis_url, 1) as ((a,), env):
        async with RPC(a.ws) as rpc:
            start = await rpc.subscribe(CHANNEL)
            await publish(env, 1003, 0)
            since = {"seq": start["seq"], "epoch": start["epoch"]}
            answer = (await rpc.call("subscribe", {"channel": CHANNEL, "since": since}, timeout=30))["result"]
            assert answer["recovered"] is False and answer["reason"] == "too_old"
            assert answer["seq"] == start["seq"] + 1003 and answer["epoch"] == start["epoch"]
        async with RPC(a.ws) as rpc:  # the last 1,000 are kept: a resume 1,000 behind is whole
            since = {"seq": start["seq"] + 3, "epoch": start["epoch"]}
            await rpc.send(
                {"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": CHANNEL, "since": since}, "id": 1}
            )
            replayed = []
            while (message := await rpc.recv(30)).get("id") != 1:
                replayed.append(message["params"]["data"]["i"])
            assert message["result"]["recovered"] is True and message["result"]["replayed"] == 1000
            assert replayed == list(range(3, 1003))


async def test_a_flushed_redis_starts_a_new_epoch_and_old_positions_are_not_recovered():
    server = PrivateRedis().start()
    try:
        env = {"REDIS_URL": server.url, "REALTIME_KEY_PREFIX": "history", "REALTIME_LEASE_TTL_MS": "1500"}
        a = Server(env).start()
        try:
            async with Collector(a.ws, a.http) as c:
                await publish(env, 3, 0)
                await eventually(lambda: len(c.messages) == 3, 15, "events before the flush")
                old = c.messages[-1]
                server.client().flushall()  # the history is gone (and the group membership)

                async def delivered_again() -> bool:
                    await publish(env, 1, 0)
                    with contextlib.suppress(AssertionError):
                        await eventually(lambda: c.messages[-1]["epoch"] != old["epoch"], 1.5, "")
                    return c.messages[-1]["epoch"] != old["epoch"]

                # the process joins again at its next beat
                await eventually(delivered_again, 20, "delivery resumed after the flush")
                assert [r["reason"] for r in c.resyncs] == ["epoch_changed"]  # told, not silent
                async with RPC(a.ws) as rpc:
                    since = {"seq": old["seq"], "epoch": old["epoch"]}
                    answer = (await rpc.call("subscribe", {"channel": CHANNEL, "since": since}))["result"]
                assert answer["recovered"] is False and answer["reason"] == "epoch_changed"
                assert answer["epoch"] == c.messages[-1]["epoch"] and answer["seq"] >= old["seq"]
        finally:
            a.stop()
    finally:
        server.close()


async def test_resuming_again_and_again_under_a_1_khz_publisher_loses_and_duplicates_nothing(redis_url):
    """A client whose connection is cut every half second, and comes back on the other
    process each time, while a publisher runs at 1 kHz: publications arrive during each
    replay, and a process that falls behind misses some (channels-redis drops what is
    over a channel's capacity). The application must get every one exactly once, in order."""
    with cluster(redis_url) as ((a, b), env):
        proxy = TcpProxy(a.port).restore()
        try:
            async with Collector(f"ws://127.0.0.1:{proxy.port}/realtime/", a.http) as c:
                publisher = asyncio.get_running_loop().create_task(publish(env, 6000, 1000))
                cuts = 0
                while not publisher.done():
                    await asyncio.sleep(random.uniform(0.3, 0.7))
                    proxy.target_port = b.port if proxy.target_port == a.port else a.port
                    proxy.cut()  # the connection drops; the next one reaches the other process
                    proxy.restore()
                    cuts += 1
                first, final = await publisher
                try:
                    await eventually(lambda: len(c.messages) >= 6000, 60, "every publication")
                except AssertionError:
                    cur = c.client.session.cursors.get(CHANNEL)
                    state = cur and (cur.epoch, cur.seq, cur.recovering, len(cur._held))
                    print("DIAG", c.subscribe_errors, len(c.messages), final, c.recovered, c.resyncs, c.closes, state)
                    raise
                assert c.items() == list(range(6000))
                c.assert_in_order_once()
                assert c.messages[0]["seq"] == first and c.messages[-1]["seq"] == final
                assert cuts >= 5 and sum(c.recovered) > 0 and c.resyncs == []
        finally:
            proxy.cut()
