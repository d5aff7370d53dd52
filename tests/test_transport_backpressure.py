"""Transport backpressure on real servers: daphne (TCP and TLS) and uvicorn, real clients
that stop reading, the probe read over HTTP, 1013 received by the client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import ssl
import time

import pytest

from tests.support.health import Probe
from tests.support.processes import rss
from tests.support.servers import Server
from tests.support.waiting import eventually
from tests.support.wsclient import RPC

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024
LIMIT = 1 * MIB
FRAME = 32 * 1024 + 200  # demo:flood payload plus the envelope


def start(database, *, server="daphne", extra_args=None, **settings):
    env = {
        **database,
        "REDIS_URL": "",
        "REALTIME_DEMO_FLOOD": "1",
        "REALTIME_MAX_BACKPRESSURE": str(settings.get("max_backpressure", LIMIT)),
        "REALTIME_BACKPRESSURE_POLICY": settings.get("policy", "drop"),
        "REALTIME_CLOSE_AFTER_DROPS": str(settings.get("close_after_drops", 1000)),
        "REALTIME_SLOW_CONSUMER_BYTES": str(LIMIT // 2),
        "REALTIME_NEVER_DROP_RESPONSES": "1" if settings.get("never_drop_responses", True) else "0",
        "REALTIME_TEST_OVERRIDES": json.dumps(settings.get("overrides", {})),
    }
    return Server(env, server=server, extra_args=extra_args).start()


async def paused_flood_client(url, *, ssl_context=None, cadence=10):
    client = RPC(url, ssl=ssl_context)
    await client.__aenter__()
    await client.subscribe(f"demo:flood:{cadence}")
    client.ws.transport.pause_reading()  # a client that stops reading: TCP fills up
    return client


async def healthy_frames(url, count, ssl_context=None):
    """A reading client on demo:clock:100 beside the slow one: ``count`` frames, none missed."""
    async with RPC(url, ssl=ssl_context) as c:
        await c.subscribe("demo:clock:100")
        return await c.frames(count, timeout=30)


@pytest.mark.parametrize("server_kind", ["daphne", "uvicorn"])
async def test_a_client_that_stops_reading_is_bounded_then_closed_with_1013(database, server_kind):
    server = start(database, server=server_kind, close_after_drops=500)
    slow = None
    try:
        probe = Probe(server)
        slow = await paused_flood_client(server.ws)
        healthy = asyncio.get_running_loop().create_task(healthy_frames(server.ws, 20))
        samples: list = []
        dropping = await probe.until(lambda t: t["drops"] > 0, 20, "frames dropped", seen=samples)
        rss_start = rss(server)
        # 250 more frames of 32 KiB dropped: unguarded, they would have queued 8 MB
        later = await probe.until(lambda t: t["drops"] >= dropping["drops"] + 250, 30, "250 more drops", seen=samples)
        rss_growth = rss(server) - rss_start
        worst = max(s["max_buffered_amount"] for s in samples)
        assert LIMIT - FRAME <= later["max_buffered_amount"] <= worst <= LIMIT + FRAME, (later, worst)  # the plateau
        assert later["slow_consumers"] == 1 and later["closes"] == 0
        assert rss_growth < 4 * MIB  # flat
        seqs = [f["seq"] for f in await healthy]
        assert len(seqs) >= 15 and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        # the balance reaches 500 after ~5 s of drops at 100 frames/s; then, reading again,
        # the client drains what was queued and receives the 1013 close
        closed = await probe.until(lambda t: t["closes"] == 1, 20, "the 1013 close")
        assert closed["connections"] == 0 and closed["channels"] == {}  # released at once
        assert await slow.close_code() == 1013
        after = await probe.aread()
        assert after["closes"] == 1 and after["connections"] == 0
        async with RPC(server.ws) as again:  # the process serves on
            assert (await again.call("ping"))["result"] == "pong"
    finally:
        if slow is not None:
            await slow.ws.close()
        server.stop()


async def test_a_passing_spike_decays_without_close(database):
    server = start(database, close_after_drops=100_000)
    try:
        probe = Probe(server)
        client = await paused_flood_client(server.ws, cadence=20)
        await probe.until(lambda t: t["max_drop_balance"] > 0, 20, "frames dropped")
        client.ws.transport.resume_reading()

        async def read_50_then_balanced() -> bool:  # a fast reader again
            for _ in range(50):
                await asyncio.wait_for(client.ws.recv(), 5)
            return (await probe.aread())["max_drop_balance"] == 0

        await eventually(read_50_then_balanced, 20, "the drop balance back to 0")
        totals = await probe.aread()
        assert totals["max_drop_balance"] == 0 and totals["closes"] == 0 and totals["connections"] == 1
        await client.__aexit__(None, None, None)
    finally:
        server.stop()


async def test_close_policy_closes_at_the_first_overrun(database):
    server = start(database, policy="close")
    try:
        probe = Probe(server)
        client = await paused_flood_client(server.ws)
        closed = await probe.until(lambda t: t["closes"] == 1, 20, "the close at the first overrun")
        assert closed["drops"] == 0
        assert await client.close_code() == 1013
    finally:
        server.stop()


@pytest.mark.parametrize("delta", [False, True])
async def test_a_channel_with_history_ruled_close_closes_over_its_threshold(database, delta):
    """Found: a channel's own ``"backpressure": "close"`` was ignored on channels with history
    (their frames, and delta frames, went through the guard with no rule): an "orders"
    channel dropped instead of closing. The process's rule here is drop."""
    rules = [{"pattern": "test:big-history", "backpressure": "close"}]
    server = start(database, close_after_drops=100_000, overrides={"POLICIES": rules})
    try:
        probe = Probe(server)
        async with RPC(server.ws) as slow, RPC(server.ws) as publisher:
            params = {"channel": "test:big-history", **({"delta": "fossil"} if delta else {})}
            answer = await slow.call("subscribe", params)
            assert answer["result"].get("delta") == ("fossil" if delta else None), answer
            slow.ws.transport.pause_reading()
            # deltas of ~6 KB each (a third of the data): 4 MB in all, past the 1 MiB threshold
            burst = {"channels": ["test:big-history"], "count": 700, "size": 16 * 1024, "fresh": 6000 if delta else 0}
            task = asyncio.get_running_loop().create_task(publisher.call("test.publish_burst", burst, timeout=60))
            closed = await probe.until(lambda t: t["closes"] == 1, 30, "the 1013 close of the channel's rule")
            assert closed["drops"] == 0
            assert await slow.close_code() == 1013
            await task
    finally:
        server.stop()


async def test_zero_disables_the_guard(database):
    server = start(database, max_backpressure=0)
    try:
        probe = Probe(server)
        client = await paused_flood_client(server.ws)
        grown = await probe.until(lambda t: t["max_buffered_amount"] > 2 * LIMIT, 20, "the queue past 2 MiB")
        assert grown["drops"] == 0 and grown["closes"] == 0  # nothing dropped or closed: unbounded
        await client.__aexit__(None, None, None)
    finally:
        server.stop()


async def test_the_same_guard_over_tls(database, tmp_path):
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_file, cert_file = tmp_path / "key.pem", tmp_path / "cert.pem"
    cert.private_key_pem.write_to_path(key_file)
    cert.cert_chain_pems[0].write_to_path(cert_file)
    port = __import__("tests.support.servers", fromlist=["free_port"]).free_port()
    endpoint = f"ssl:{port}:interface=127.0.0.1:privateKey={key_file}:certKey={cert_file}"
    server = Server(
        {
            **database,
            "REDIS_URL": "",
            "REALTIME_DEMO_FLOOD": "1",
            "REALTIME_MAX_BACKPRESSURE": str(LIMIT),
            "REALTIME_CLOSE_AFTER_DROPS": "300",
        },
        port=port,
        extra_args=["-e", endpoint],
        bind_plain=False,
    ).start()
    try:
        client_ctx = ssl.create_default_context()
        ca.configure_trust(client_ctx)
        url = f"wss://127.0.0.1:{port}/realtime/"
        probe = Probe(server, scheme="https", context=client_ctx)
        slow = await paused_flood_client(url, ssl_context=client_ctx)
        samples: list = []
        await probe.until(lambda t: t["drops"] > 0, 20, "frames dropped", seen=samples)
        await probe.until(lambda t: t["closes"] == 1, 20, "the 1013 close", seen=samples)
        worst = max(s["max_buffered_amount"] for s in samples)
        assert LIMIT - FRAME <= worst <= LIMIT + FRAME + 64 * 1024, worst  # plus TLS records' overhead
        async with RPC(url, ssl=client_ctx) as c:
            assert (await c.call("ping"))["result"] == "pong"
        assert await slow.close_code() == 1013
    finally:
        server.stop()


async def test_a_custom_consumer_gets_the_same_guard(database):
    server = start(database, close_after_drops=200)
    try:
        url = server.ws.replace("/realtime/", "/guarded/")
        async with RPC(url) as reader:
            first = [json.loads(await reader.ws.recv())["n"] for _ in range(5)]
            assert first == list(range(first[0], first[0] + 5))
        slow = RPC(url)
        await slow.__aenter__()
        await slow.ws.recv()
        slow.ws.transport.pause_reading()
        await eventually(lambda: "closed GuardedFloodConsumer with 1013" in server.output(), 20, "the guard's close")
        assert await slow.close_code() == 1013
        # The guard's way, with the same settings: frames over the threshold dropped, then
        # the close at CLOSE_AFTER_DROPS (200), the queue bounded meanwhile.
        line = re.search(
            r"closed GuardedFloodConsumer with 1013: backpressure \((\d+) bytes queued, (\d+) drops\)", server.output()
        )
        assert line is not None, server.output()[-2000:]
        queued, dropped = int(line[1]), int(line[2])
        assert dropped == 200 and LIMIT < queued <= LIMIT + FRAME, (queued, dropped)
    finally:
        server.stop()


@pytest.mark.parametrize("never_drop", [True, False])
async def test_responses_are_not_dropped_unless_configured(database, never_drop):
    """Answers are written even over the threshold unless NEVER_DROP_RESPONSES is off: one
    owed from before (its request came while the client read) and a small one asked while
    the queue is full (within the unread-answer budget, docs/admission.md)."""
    server = start(database, close_after_drops=100_000, never_drop_responses=never_drop)
    try:
        probe = Probe(server)
        client = RPC(server.ws)
        await client.__aenter__()
        await client.subscribe("demo:flood:10")
        await client.send({"jsonrpc": "2.0", "method": "test.sleep", "params": {"seconds": 3}, "id": "owed"})
        client.ws.transport.pause_reading()  # a client that stops reading: TCP fills up
        await probe.until(lambda t: t["drops"] > 5, 15, "dropping")  # over the threshold, dropping
        await client.send({"jsonrpc": "2.0", "method": "ping", "id": "while-full"})
        before = (await probe.aread())["drops"]
        await probe.until(lambda t: t["drops"] > before + 20, 15, "20 more drops")
        owed_done = lambda: probe.read("instances")[0]["admission"]["completed"] >= 1  # noqa: E731
        await probe.until(lambda _: owed_done(), 15, "the owed answer")  # the owed answer was sent (or dropped)
        resumed_ms = time.time() * 1000
        client.ws.transport.resume_reading()
        answered = set()
        while True:  # read the backlog until frames published after the resume arrive
            message = json.loads(await asyncio.wait_for(client.ws.recv(), 10))
            if "id" in message:
                answered.add(message["id"])
            elif message.get("method") == "message" and message["params"]["ts"] > resumed_ms + 500:
                break
        assert answered == ({"owed", "while-full"} if never_drop else set())
        await client.__aexit__(None, None, None)
    finally:
        server.stop()


async def test_a_conflated_state_channel_converges_to_its_latest_value_where_drop_stays_behind(database):
    """A client that stops reading during bursts on three channels: the conflated state
    channel holds its newest frame and delivers it as soon as the socket drains; the
    dropped state channel and the event channel (never conflated, whatever its rule says)
    keep the value of the last frame that fit."""
    conflated, dropped, events = "test:state-conflated", "test:state-dropped", "test:events"
    rules = [{"pattern": conflated, "backpressure": "conflate"}, {"pattern": events, "backpressure": "conflate"}]
    server = start(database, close_after_drops=100_000, overrides={"POLICIES": rules})
    slow = RPC(server.ws)
    try:
        probe = Probe(server)
        await slow.__aenter__()
        for channel in (conflated, dropped, events):
            await slow.subscribe(channel)
        slow.ws.transport.pause_reading()
        burst = {"channels": [conflated, dropped, events], "count": 150, "size": 16 * 1024}
        samples: list = []
        async with RPC(server.ws) as publisher:
            call = asyncio.get_running_loop().create_task(publisher.call("test.publish_burst", burst, timeout=60))
            # the queue, sampled through the burst until the guard has held and dropped
            await probe.until(
                lambda t: call.done() and t["drops"] and t["conflated"], 60, "held, dropped", seen=samples
            )
            assert (await call)["result"] == 450
        one_frame = 16 * 1024 + 300
        assert max(s["max_buffered_amount"] for s in samples) <= LIMIT + one_frame  # held frames are not queued
        held = (await probe.aread("instances"))[0]
        assert held["backpressure"]["holding"] <= 1  # one connection holds (or just wrote) its frame
        [mine] = [c for c in held["top_connections"] if conflated in c["channels"]]
        assert mine["conflated"] == held["backpressure"]["conflated"] > 0  # counted per connection and in total
        last: dict[str, int] = {}
        seqs: dict[str, list[int]] = {}

        async def read_until_latest() -> bool:
            message = await slow.recv(10)
            if message.get("method") == "message":
                params = message["params"]
                last[params["channel"]] = params["data"]["n"]
                seqs.setdefault(params["channel"], []).append(params["seq"])
            return last.get(conflated) == 149

        slow.ws.transport.resume_reading()
        await eventually(read_until_latest, 20, "the conflated channel's latest value")
        with contextlib.suppress(TimeoutError):  # and whatever else was queued
            while True:
                message = await slow.recv(1.0)
                if message.get("method") == "message":
                    params = message["params"]
                    last[params["channel"]] = params["data"]["n"]
                    seqs.setdefault(params["channel"], []).append(params["seq"])
        # The dropped ones lost frames for good, the latest among them whenever it did not fit
        # (the drop rule lets one frame in three through over the threshold: the last may be
        # one of those, so their last value is not asserted)
        assert all(len(seqs.get(channel, [])) < 150 for channel in (dropped, events)), seqs
        gaps = [b - a for a, b in zip(seqs[conflated], seqs[conflated][1:], strict=False)]
        assert max(gaps) > 1  # the seq jump shows what was conflated
    finally:
        await slow.ws.close()
        server.stop()


async def test_a_reader_that_wakes_every_2_5_s_holds_the_latest_value_of_a_conflated_10_hz_channel(database):
    """A 10 Hz state channel and a reader that reads once every 2.5 s (a background tab, a
    phone between syncs), with ``conflate`` and with ``drop`` side by side: after each read,
    once the server has drained its queue, the conflated reader holds the value published
    last; the dropped one holds the last frame that fitted when its queue filled, several
    publications old, until a later one happens to fit. Each queue stays within the
    threshold plus one frame."""
    conflated, dropped = "test:state-conflated", "test:state-dropped"
    limit, size = 64 * 1024, 16 * 1024
    rules = [{"pattern": conflated, "backpressure": "conflate"}]
    server = start(database, max_backpressure=limit, close_after_drops=100_000, overrides={"POLICIES": rules})
    readers: dict[str, RPC] = {}

    async def read_awake(reader: RPC, latest: int) -> int:
        """Read what is there, and what the server writes as its queue drains, until the
        latest value or a quiet second (twenty of the hub's drains); the value held."""
        value = -1
        reader.ws.transport.resume_reading()
        with contextlib.suppress(TimeoutError):
            while value != latest:
                message = await reader.recv(1.0)
                if message.get("method") == "message":
                    value = message["params"]["data"]["n"]
        reader.ws.transport.pause_reading()
        return value

    try:
        probe = Probe(server)
        for channel in (conflated, dropped):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # what the guard cannot see: small
            sock.connect(("127.0.0.1", server.port))
            readers[channel] = RPC(server.ws, sock=sock)
            await readers[channel].__aenter__()
            await readers[channel].subscribe(channel)
            readers[channel].ws.transport.pause_reading()
        held: dict[str, list[tuple[int, int]]] = {conflated: [], dropped: []}  # (latest, held) per read
        queued: list[int] = []
        n = 0
        async with RPC(server.ws) as publisher:
            for _read in range(4):
                for _ in range(25):  # 10 Hz for 2.5 s while the readers sleep
                    burst = {"channels": [conflated, dropped], "count": 1, "size": size, "start": n}
                    assert (await publisher.call("test.publish_burst", burst))["result"] == 2
                    n += 1
                    await asyncio.sleep(0.1)
                queued.append((await probe.aread("totals"))["max_buffered_amount"])
                for channel, reader in readers.items():
                    held[channel].append((n - 1, await read_awake(reader, n - 1)))
        assert all(value == latest for latest, value in held[conflated]), held  # the latest, every time
        assert all(value < latest - 5 for latest, value in held[dropped]), held  # several publications old
        assert max(queued) <= limit + size + 300, queued
        assert (await probe.aread("totals"))["conflated"] > 0
    finally:
        for reader in readers.values():
            with contextlib.suppress(Exception):
                reader.ws.transport.resume_reading()
                await reader.ws.close()
        server.stop()
