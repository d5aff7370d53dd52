"""The cluster under faults: two daphne processes on a private redis-server that the test
kills, stops or pauses during fan-out, and hostile or unlucky clients.

Every fault here is one found by trying the cluster as an attacker would; each test
fails on the code before its fix (docs/reliability.md tables them).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import websockets

from realtime_app.wire.names import group_name
from tests.support.cluster import Reader
from tests.support.private_redis import PrivateRedis
from tests.support.processes import rss
from tests.support.servers import ROOT, Server, servers
from tests.support.waiting import eventually
from tests.support.wsclient import RPC

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

LEASE_TTL_MS = 1500
PREFIX = "faults"


def env_for(redis_server: PrivateRedis, layer: str = "core", **overrides: Any) -> dict[str, str]:
    env = {
        "REALTIME_CHANNEL_LAYER": layer,
        "REDIS_URL": redis_server.url,
        "REALTIME_KEY_PREFIX": PREFIX,
        "REALTIME_LEASE_TTL_MS": str(LEASE_TTL_MS),
        "REALTIME_TEST_OVERRIDES": json.dumps(overrides),
    }
    return env


async def batch_call(rpc: RPC, batch: list[dict[str, Any]], timeout: float = 30) -> list[dict[str, Any]]:
    """Send a JSON-RPC batch and return its answer (frames that arrive first are skipped)."""
    await rpc.send(batch)
    while True:
        answer = await rpc.recv(timeout)
        if isinstance(answer, list):
            return answer


def probes(client) -> list[dict[str, Any]]:
    now = time.time() * 1000
    ids = client.zrangebyscore(f"{PREFIX}:instances", now, "+inf")
    return [json.loads(raw) for raw in client.mget([f"{PREFIX}:probe:{i}" for i in ids]) if raw] if ids else []


def log_lines(server: Server, needle: str) -> list[str]:
    return [line for line in server.output().splitlines() if needle in line]


@pytest.mark.parametrize(
    ("fault", "layer"), [("kill", "core"), ("stop", "core"), ("pause", "core"), ("kill", "pubsub")]
)
async def test_fan_out_survives_redis_going_away_and_coming_back(private_redis, fault, layer):
    """Found: after a Redis restart no subscription ever received a frame again."""
    channels_a, channels_b = ["demo:clock:200", "demo:events"], ["demo:clock:200", "demo:clock:300", "demo:events"]
    with servers(2, env_for(private_redis, layer)) as (a, b):
        async with Reader(a.ws, channels_a) as ra, Reader(b.ws, channels_b) as rb:
            await eventually(
                lambda: all(ra.seqs(c) for c in channels_a[:1]) and rb.seqs("demo:clock:300"), 10, "frames"
            )
            before = {c: max(ra.seqs(c) + rb.seqs(c), default=0) for c in ("demo:clock:200", "demo:clock:300")}
            rss_before = [rss(a), rss(b)]
            if fault == "pause":
                private_redis.pause()
            else:
                getattr(private_redis, fault)()
            await asyncio.sleep(10)
            rss_during = [rss(a), rss(b)]
            if fault == "pause":
                private_redis.resume()
            else:
                private_redis.start()
            back = time.monotonic()
            await eventually(
                lambda: (
                    all(ra.has_frame_after(c, back) for c in channels_a[:1])
                    and all(rb.has_frame_after(c, back) for c in channels_b[:2])
                ),
                5,
                "frames on every subscription after Redis came back",
            )
            took = time.monotonic() - back
            print(f"{fault}: frames resumed {took:.2f} s after Redis was back")
            # event channels resume too: a publication after the fault reaches both processes
            async with RPC(a.ws) as publisher:

                async def published() -> dict[str, Any] | None:
                    answer = await publisher.call("publish", {"channel": "demo:events", "data": {"after": fault}})
                    told = answer.get("error", {}).get("data", {})
                    if told.get("reason") == "backplane_unavailable":  # as the pool reconnects: again when told
                        await asyncio.sleep(told["retry_after_ms"] / 1000)
                        return None
                    return answer

                answer = await eventually(published, 5, "a publish after the fault")
                assert "result" in answer, answer
            await eventually(
                lambda: ra.has_frame_after("demo:events", back) and rb.has_frame_after("demo:events", back),
                5,
                "an event after the fault",
            )
            assert ra.closed is None and rb.closed is None  # nobody was disconnected
            for reader in (ra, rb):
                for channel in reader.channels:
                    seqs = reader.seqs(channel)
                    assert seqs == sorted(set(seqs)), (channel, seqs)  # no duplicate, never backwards
            for channel, last in before.items():
                assert max(ra.seqs(channel) + rb.seqs(channel)) > last  # numbering went on, upwards
            # exactly one ticker per channel in the cluster, once the probes are republished
            client = private_redis.client()

            def one_ticker_each() -> bool:
                found = probes(client)
                tickers = [t for p in found for t in p["tickers"]]
                return len(found) == 2 and sorted(tickers) == ["demo:clock:200", "demo:clock:300"]

            await eventually(one_ticker_each, 10, "one ticker per channel")
            assert all(during - start < 30 * 2**20 for start, during in zip(rss_before, rss_during, strict=True))
        for server in (a, b):  # one line when Redis goes, one when it is back, no traceback
            assert len(log_lines(server, "unreachable:")) <= 1, server.output()
            assert len(log_lines(server, "still unreachable")) == 0, server.output()
            assert len(log_lines(server, "reachable again")) <= 1, server.output()
            assert "Traceback" not in server.output(), server.output()
        assert any(log_lines(s, "unreachable:") for s in (a, b))


async def test_delivery_continues_past_group_expiry(private_redis):
    """Found: channels-redis drops group members older than group_expiry (24 h by default)
    and the hub never joined again; here group_expiry is 3 s."""
    env = {**env_for(private_redis), "REALTIME_TEST_GROUP_EXPIRY": "3"}
    with servers(1, env) as (a,):
        async with Reader(a.ws, ["demo:clock:200"]) as reader:
            await eventually(lambda: reader.seqs("demo:clock:200"), 10, "first frame")
            await asyncio.sleep(10)  # three expiries
            moment = time.monotonic()
            await eventually(lambda: reader.has_frame_after("demo:clock:200", moment), 5, "frames after group_expiry")


async def test_a_quiet_cluster_logs_no_error(private_redis):
    """Found: an idle cluster logged an ERROR traceback every 5-6 s (the blocking pop
    outlived redis-py 8's socket timeout)."""
    with servers(2, env_for(private_redis)) as (a, b):
        async with Reader(a.ws, ["demo:events"]), Reader(b.ws, ["demo:events"]):
            await asyncio.sleep(60)
        for server in (a, b):
            assert not log_lines(server, " ERROR "), server.output()
            assert "Traceback" not in server.output()


@pytest.mark.parametrize("fault", ["kill", "pause"])
async def test_a_disconnect_during_an_outage_is_cleaned_up(private_redis, fault):
    """Found: a connection that left while Redis failed stayed forever, its tickers too.
    (kill: the backplane refuses at once; pause: it answers nothing until it is resumed,
    so leaving and releasing are retried by the beat.)"""
    with servers(1, env_for(private_redis)) as (a,):
        client = private_redis.client()
        reader = await Reader(a.ws, ["demo:clock:200", "demo:clock:300", "demo:events"]).__aenter__()
        await eventually(lambda: reader.seqs("demo:clock:300"), 10, "frames")
        private_redis.kill() if fault == "kill" else private_redis.pause()
        try:
            await asyncio.wait_for(reader.__aexit__(), 10)
            await asyncio.sleep(2)
        finally:
            private_redis.start() if fault == "kill" else private_redis.resume()

        def all_gone() -> bool:
            found = probes(client)
            return (
                len(found) == 1
                and found[0]["connections"] == 0
                and found[0]["subscriptions"] == 0
                and found[0]["tickers"] == []
            )

        await eventually(all_gone, 15, "the probe back to zero")
        for channel in ("demo:clock:200", "demo:clock:300", "demo:events"):
            await eventually(lambda c=channel: client.zcard(f"{PREFIX}:asgi:group:{group_name(c)}") == 0, 10, "left")
            await eventually(lambda c=channel: not client.exists(f"{PREFIX}:lease:{group_name(c)}"), 10, "released")


async def shell_publish(server: Server, channel: str, data_expr: str) -> subprocess.CompletedProcess[str]:
    """``realtime_app.publish(channel, <data_expr>)`` from another process of the cluster."""
    code = f"import realtime_app; print(realtime_app.publish({channel!r}, {data_expr}))"
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT,
        env=server.env,
        capture_output=True,
        text=True,
    )


async def test_an_oversize_publication_is_refused_and_delivery_goes_on(private_redis):
    """Found: one frame over 1 MiB (daphne's limit) silently stopped the process's delivery."""
    with servers(1, env_for(private_redis)) as (a,):
        async with Reader(a.ws, ["demo:events", "demo:clock:200"]) as reader:
            refused = await shell_publish(a, "demo:events", "'x' * 1_100_000")
            assert refused.returncode != 0 and "PublicationTooLarge" in refused.stderr, refused.stderr[-2000:]
            ok = await shell_publish(a, "demo:events", "'small'")
            seq = int(ok.stdout.split()[-1])
            await eventually(lambda: seq in reader.seqs("demo:events"), 10, "the next event")
            moment = time.monotonic()
            await eventually(lambda: reader.has_frame_after("demo:clock:200", moment), 5, "ticks go on")
        assert "Traceback" not in a.output()


async def test_a_send_the_server_refuses_closes_that_connection_only(private_redis):
    """With the publication limit off, daphne itself refuses a frame over 1 MiB: the
    connections it was sent to are closed with 1011, the process keeps delivering."""
    with servers(1, env_for(private_redis, MAX_PUBLICATION_BYTES=0)) as (a,):
        # test:events: an event channel without a max_bytes of its own (demo:events has 4 KiB)
        async with Reader(a.ws, ["test:events"]) as victim, Reader(a.ws, ["demo:clock:200"]) as bystander:
            assert (await shell_publish(a, "test:events", "'x' * 1_100_000")).returncode == 0
            await eventually(lambda: victim.closed is not None, 10, "the victim closed")
            assert victim.closed == 1011
            moment = time.monotonic()
            await eventually(lambda: bystander.has_frame_after("demo:clock:200", moment), 5, "others go on")
            async with Reader(a.ws, ["test:events"]) as fresh:
                seq = int((await shell_publish(a, "test:events", "'small'")).stdout.split()[-1])
                await eventually(lambda: seq in fresh.seqs("test:events"), 10, "events go on")
        assert len(log_lines(a, "a send failed")) == 1, a.output()
        assert "Traceback" not in a.output()


async def test_hostile_cadences_do_not_starve_a_legitimate_subscriber(private_redis):
    """Found: 20 anonymous connections x 100 cadences started 2,000 tickers; a 250 ms
    subscriber then got 5 frames in 10 s instead of 40. (Each connection holds at most
    MAX_SUBSCRIPTIONS = 100, so all 2,000 asks stand.)"""
    with servers(1, env_for(private_redis)) as (a,):
        async with Reader(a.ws, ["demo:clock:250"]) as legit:
            attackers = [RPC(a.ws, address=f"198.51.100.{i}") for i in range(20)]  # 20 clients
            for attacker in attackers:
                await attacker.__aenter__()
            try:
                granted = set()
                for i, attacker in enumerate(attackers):  # 20 x 100 = 2,000 distinct cadences asked
                    for half in (0, 50):
                        batch = [
                            {
                                "jsonrpc": "2.0",
                                "method": "subscribe",
                                "params": {"channel": f"demo:clock:{300 + i * 100 + half + k}"},
                                "id": half + k,
                            }
                            for k in range(50)  # MAX_BATCH
                        ]
                        answers = await batch_call(attacker, batch)
                        granted |= {r["result"]["channel"] for r in answers if "result" in r}
                assert len(granted) <= 16  # MAX_CADENCES_PER_FAMILY, the legitimate one included
                start = len(legit.seqs("demo:clock:250"))
                # they keep coming: 20 more frames (4 a second are published) within 30 s
                await eventually(lambda: len(legit.seqs("demo:clock:250")) - start >= 20, 30, "20 more frames")
                seqs = legit.seqs("demo:clock:250")[start:]
                assert len(seqs) >= 0.9 * (seqs[-1] - seqs[0] + 1), seqs  # at most 10 % of frames lost
                tickers = probes(private_redis.client())[0]["ticker_count"]
                assert tickers <= 16, tickers
            finally:
                for attacker in attackers:
                    await attacker.__aexit__()


async def test_a_thousand_concurrent_subscribes_succeed(private_redis):
    """Found: 150 clients x 5 concurrent subscribes: 255 of 750 answered -32603
    (MaxConnectionsError: redis-py caps a pool at 100 connections)."""
    env = env_for(private_redis, MAX_CADENCES_PER_FAMILY=0, MAX_TICKERS=0)
    with servers(1, env) as (a,):
        clients = [RPC(a.ws, address=f"198.51.100.{i}") for i in range(200)]  # 200 clients
        await asyncio.gather(*(c.__aenter__() for c in clients))
        try:

            async def five(i: int, client: RPC) -> list[dict[str, Any]]:
                batch = [
                    {
                        "jsonrpc": "2.0",
                        "method": "subscribe",
                        "params": {"channel": f"demo:clock:{30000 + i * 5 + k}"},
                        "id": k,
                    }
                    for k in range(5)
                ]
                return await batch_call(client, batch, timeout=60)

            answers = [r for batch in await asyncio.gather(*(five(i, c) for i, c in enumerate(clients))) for r in batch]
            assert len(answers) == 1000
            errors = [r["error"] for r in answers if "error" in r]
            assert not errors, errors[:3]
        finally:
            await asyncio.gather(*(c.__aexit__() for c in clients))
        assert "Traceback" not in a.output()


async def test_connections_per_user_are_capped(private_redis):
    from tests.support.servers import login, prepare_database

    database = prepare_database(os.path.join(private_redis.dir, "db.sqlite3"))
    with servers(1, {**env_for(private_redis, MAX_CONNECTIONS_PER_USER=3), **database}) as (a,):
        cookie = login(a.http, "demo", "demo")
        opened = [await RPC(a.ws, cookie=cookie).__aenter__() for _ in range(3)]
        try:
            async with RPC(a.ws, cookie=cookie) as fourth:
                with pytest.raises(websockets.ConnectionClosed) as info:
                    await fourth.call("ping")
                assert info.value.rcvd.code == 1008
            assert (await opened[0].call("ping"))["result"] == "pong"
            async with RPC(a.ws) as anonymous:  # another identity is not affected
                assert (await anonymous.call("ping"))["result"] == "pong"
        finally:
            for rpc in opened:
                await rpc.__aexit__()
        async with RPC(a.ws, cookie=cookie) as again:  # the slots came back
            assert (await again.call("ping"))["result"] == "pong"


async def test_unencodable_input_is_answered_like_any_bad_input(private_redis):
    """Found: a lone surrogate in an id, method or channel closed the sender with 1011 and
    a traceback; a publication of 1e400 answered -32603 and burned a seq."""
    with servers(1, env_for(private_redis)) as (a,):
        async with Reader(a.ws, ["demo:events"]) as reader, RPC(a.ws) as c:
            raw = [
                '{"jsonrpc":"2.0","method":"ping","id":"\\ud800"}',
                '{"jsonrpc":"2.0","method":"\\ud800\\n2026-01-01 ERROR forged","id":1}',
                '{"jsonrpc":"2.0","method":"subscribe","params":{"channel":"demo:\\ud800"},"id":2}',
            ]
            for text in raw:
                await c.ws.send(text)
                answer = await c.recv()
                assert answer.get("result") == "pong" or answer["error"]["code"] in (-32600, -32602), answer
            first = (await c.call("publish", {"channel": "demo:events", "data": 1}))["result"]["seq"]
            await c.ws.send(
                '{"jsonrpc":"2.0","method":"publish","params":{"channel":"demo:events","data":1e400},"id":9}'
            )
            refused = await c.recv()
            assert refused["error"]["code"] == -32602 and refused["error"]["data"]["reason"] == "invalid_data"
            await c.ws.send(
                '{"jsonrpc":"2.0","method":"publish","params":{"channel":"demo:events","data":"\\ud800"},"id":10}'
            )
            refused = await c.recv()  # a lone surrogate is bad input, like any other
            assert refused["error"]["code"] == -32602 and refused["error"]["data"]["reason"] == "invalid_string"
            assert (await c.call("publish", {"channel": "demo:events", "data": 2}))["result"]["seq"] == first + 1
            await eventually(lambda: first + 1 in reader.seqs("demo:events"), 5, "the next event")
            assert (await c.call("ping"))["result"] == "pong"
        output = a.output()
        assert "Traceback" not in output
        assert not [line for line in output.splitlines() if line.startswith("2026-01-01 ERROR forged")]


async def test_seq_keys_expire_when_idle_and_never_go_back_after_data_loss(private_redis):
    with servers(1, env_for(private_redis, SEQ_IDLE_TTL_MS=60000)) as (a,):
        client = private_redis.client()
        async with Reader(a.ws, ["demo:clock:200"]) as reader:
            await eventually(lambda: len(reader.seqs("demo:clock:200")) >= 3, 10, "frames")
            ttl = client.pttl(f"{PREFIX}:seq:{group_name('demo:clock:200')}")
            assert 0 < ttl <= 60000
            for key in client.scan_iter(f"{PREFIX}*"):  # the private server loses the cluster's data
                client.delete(key)
            last = reader.seqs("demo:clock:200")[-1]
            moment = time.monotonic()
            await eventually(lambda: reader.has_frame_after("demo:clock:200", moment + 1), 10, "frames after the loss")
            seqs = reader.seqs("demo:clock:200")
            assert seqs == sorted(set(seqs)) and seqs[-1] > last


@pytest.mark.parametrize(
    ("server", "expected"), [("daphne", {"utf8": 1006, "huge": 1006}), ("uvicorn", {"utf8": 1007, "huge": 1009})]
)
async def test_invalid_utf8_and_huge_frames_close_as_documented(server, expected):
    """docs/protocol.md: the server's WebSocket layer judges these before the application:
    daphne (autobahn) drops the connection (1006), uvicorn closes with 1007 / 1009."""
    site = Server({"REDIS_URL": ""}, server=server).start()
    try:
        for case, payload in (("utf8", b'{"jsonrpc":"2.0","method":"\xff","id":1}'), ("huge", "x" * 1_100_000)):
            async with RPC(site.ws) as c:
                await c.ws.send(payload, text=True)
                with pytest.raises(websockets.ConnectionClosed) as info:
                    await c.recv()
                assert (info.value.rcvd.code if info.value.rcvd else 1006) == expected[case], case
        async with RPC(site.ws) as c:  # and the process goes on
            assert (await c.call("ping"))["result"] == "pong"
        # uvicorn's websockets-sansio logs a traceback of its own for invalid UTF-8; none is ours
        assert "realtime_app/" not in site.output()
        if server == "daphne":
            assert "Traceback" not in site.output()
    finally:
        site.stop()


@pytest.mark.parametrize("implementation", ["websockets", "wsproto"])
async def test_an_unsupported_server_closes_with_1011_as_documented(implementation):
    """Found: docs said 1011 under uvicorn's other WebSocket implementations; the client got
    an HTTP 403. Found later: ``wsproto`` was taken for ``websockets-sansio`` (both have a
    ``conn``) and its first frame failed instead."""
    site = Server({"REDIS_URL": ""}, server="uvicorn", extra_args=["--ws", implementation]).start()
    try:
        for _ in range(2):
            async with RPC(site.ws) as c:
                with pytest.raises(websockets.ConnectionClosed) as info:
                    await c.recv()
                assert (info.value.rcvd.code, info.value.rcvd.reason) == (1011, "unsupported server")
        assert len([line for line in site.output().splitlines() if "refusing WebSocket connections" in line]) == 1
    finally:
        site.stop()
