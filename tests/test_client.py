"""The Python client against a real daphne: calls, timeouts, reconnects, close codes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import inspect
import json
import logging
import socket
from pathlib import Path

import pytest

from realtime_app.client import RealtimeClient, bind_adaptive_channel, is_reconnectable_close_code
from realtime_app.exceptions import RPCError
from tests.support.servers import Server
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def server():
    s = Server({"REDIS_URL": ""}).start()
    yield s
    s.stop()


def digest(data):
    """One publication's data, whatever the order of its keys: a short comparable value."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def test_close_code_taxonomy():
    assert all(is_reconnectable_close_code(c) for c in (1001, 1005, 1006, 1011, 1012, 1013))
    assert not any(is_reconnectable_close_code(c) for c in (1000, 1003, 1008, 1009, 4001, 4403, None))


async def test_calls_errors_and_timeouts(server):
    async with RealtimeClient(server.ws) as client:
        assert await client.call("ping") == "pong"
        with pytest.raises(RPCError) as info:
            await client.call("subscribe", {"channel": "atelier:load"})
        assert (info.value.code, info.value.reason) == (-32001, "forbidden_channel")
        with pytest.raises(TimeoutError):
            await client.call("test.sleep", {"seconds": 1}, timeout=0.2)
        assert await client.call("ping") == "pong"  # the connection survives a timed-out call


async def test_reconnects_and_resubscribes_after_a_server_restart(server):
    frames: list[dict] = []
    states: list[str] = []
    client = RealtimeClient(server.ws, backoff_initial=0.1, backoff_max=0.5)
    client.on_state.append(states.append)
    await client.connect()
    try:
        await client.subscribe("demo:clock:100", frames.append)
        await eventually(lambda: len(frames) >= 2)
        server.stop()
        await eventually(lambda: client.state == "reconnecting")
        restarted = Server({"REDIS_URL": ""}, port=server.port).start()
        try:
            count = len(frames)
            await eventually(lambda: len(frames) >= count + 3)
            assert client.state == "open" and "reconnecting" in states
        finally:
            restarted.stop()
    finally:
        await client.close()


@pytest.mark.parametrize(("code", "reconnects"), [(1013, True), (1012, True), (1008, False), (4003, False)])
async def test_close_codes_decide_the_reconnect(server, code, reconnects):
    closes: list[tuple] = []
    client = RealtimeClient(server.ws, backoff_initial=0.05, backoff_max=0.2)
    client.on_close.append(lambda c, r, again: closes.append((c, again)))
    await client.connect()
    try:
        await client.notify("test.close", {"code": code})
        await eventually(lambda: closes)
        assert closes[0] == (code, reconnects)
        if reconnects:
            await eventually(lambda: client.state == "open")
            assert await client.call("ping") == "pong"
        else:
            await eventually(lambda: client.socket.runner is not None and client.socket.runner.done())  # the loop ended
            assert client.state == "closed" and len(closes) == 1 and client.socket.runner.exception() is None
    finally:
        await client.close()


async def test_adaptive_binding_switches_make_before_break(server):
    """A slow handler: the cadence steps down and the stream has no hole longer than the old cadence."""
    received: list[tuple[float, str]] = []  # (the server's ts of the frame, its channel)
    slow = {"on": False}

    async def handler(params):
        received.append((params["ts"] / 1000, params["channel"]))
        if slow["on"]:
            await asyncio.sleep(0.3)

    async with RealtimeClient(server.ws) as client:
        bound = await bind_adaptive_channel(client, "demo:clock", 100, handler, ladder=[100, 400], recovery_window=4)
        await eventually(lambda: len(received) >= 5)
        assert bound.interval_ms == 100
        slow["on"] = True
        await eventually(lambda: bound.interval_ms == 400)
        switched = len(received)
        await eventually(lambda: any(ch == "demo:clock:400" for _, ch in received[switched:]))
        # No hole in what the server sent this client: by the frames' own timestamps (the
        # tickers' clocks, not this loop's, which a busy machine delays), no gap reaches
        # two periods of the slower cadence.
        times = sorted(t for t, _ in received)
        assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 2 * 0.4 + 0.1
        slow["on"] = False
        await eventually(lambda: bound.interval_ms == 100, timeout=20)
        await bound.close()


async def test_refused_subscribes_reach_the_application(server):
    """Found: a subscribe before connect() answered at once and a refusal on the way
    (or on a renewal after a reconnect) was swallowed."""
    seen: list[tuple[str, str]] = []
    client = RealtimeClient(server.ws, backoff_initial=0.1, backoff_max=0.5)
    client.on_subscribe_error.append(lambda channel, error: seen.append((channel, error.reason)))
    mine: list[Exception] = []
    pending = await client.subscribe("atelier:load", lambda _: None, on_error=mine.append)
    assert pending == {"channel": "atelier:load", "pending": True}  # not an answer of the server
    await client.connect()
    try:
        await eventually(lambda: seen)
        assert seen == [("atelier:load", "forbidden_channel")] and mine[0].reason == "forbidden_channel"
        with pytest.raises(RPCError) as info:  # once connected, a refusal is raised
            await client.subscribe("test:staff", lambda _: None)
        assert info.value.reason == "forbidden_channel"
    finally:
        await client.close()


# -- refusals: a typed error and an opt-in retry (the browser module passes the same vectors)

REFUSAL_VECTORS = __import__("json").loads(
    (__import__("pathlib").Path(__file__).parent / "vectors" / "refusal.json").read_text()
)


@pytest.mark.parametrize("case", REFUSAL_VECTORS["errors"], ids=lambda c: f"{c['error']['code']}-{c['refused']}")
def test_refusals_become_a_typed_error(case):
    from realtime_app.exceptions import Refused, error_from_response

    error = error_from_response(case["error"])
    assert isinstance(error, Refused) is case["refused"]
    assert error.code == case["error"]["code"] and error.reason == case["error"]["data"]["reason"]
    if case["refused"]:
        assert error.retry_after_ms == case["error"]["data"]["retry_after_ms"]
        assert error.snapshot == case["error"]["data"].get("snapshot")


@pytest.mark.parametrize("case", REFUSAL_VECTORS["delays"], ids=lambda c: f"{c['retry_after_ms']}-{c['u']}")
def test_the_retry_delay_is_jittered_upward_only(case):
    from realtime_app.wire.retry import retry_delay_ms

    assert retry_delay_ms(case["retry_after_ms"], case["u"]) == case["delay_ms"] >= case["retry_after_ms"]


async def test_a_rate_limited_call_raises_refused_and_an_opt_in_retry_gets_through(server):
    from realtime_app.exceptions import Refused

    async with RealtimeClient(server.ws) as client:
        # A full bucket of 18 tokens, demo.echo costs 1, 9 come back a second: calls one
        # after the other empty it, however slow the machine is, unless each takes 111 ms.
        with pytest.raises(Refused) as refused:
            for i in range(200):
                await client.call("demo.echo", {"text": str(i)})
        assert i >= 18
        assert refused.value.reason == "rate_limited" and 0 < refused.value.retry_after_ms <= 112
        assert await client.call("demo.echo", {"text": "again"}, retries=3) == {"text": "again"}


async def test_a_connection_cut_during_the_handshake_is_retried_not_fatal(server):
    """Found under load: a connection dropped while the client waited for the handshake's
    answer raised ``InvalidMessage`` out of the connection loop, and the client never
    reconnected (nor said it closed). The first handshakes here are cut, then the server answers."""
    cuts = 0

    async def cut_then_forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal cuts
        if cuts < 3:
            cuts += 1
            await reader.readuntil(b"\r\n\r\n")  # the request arrives; no answer
            writer.close()
            return
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", server.port)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
            sink.close()

        await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer), return_exceptions=True)

    proxy = await asyncio.start_server(cut_then_forward, "127.0.0.1", 0)
    port = proxy.sockets[0].getsockname()[1]
    client = RealtimeClient(
        f"ws://127.0.0.1:{port}/realtime/", origin=server.http, backoff_initial=0.05, backoff_max=0.1
    )
    closes: list[tuple[int | None, bool]] = []
    client.on_close.append(lambda code, reason, again: closes.append((code, again)))
    try:
        await client.connect(timeout=20)
        assert await client.call("ping") == "pong"
        assert closes == [(1006, True)] * 3
    finally:
        await client.close()
        proxy.close()


def test_the_python_client_has_every_capability_of_the_browser_one():
    """One list (tests/vectors/client_capabilities.json) for both clients; the browser half
    is tests/js/capabilities.test.mjs."""
    from realtime_app.client.adaptive_channel import AdaptiveChannel

    listed = json.loads((Path(__file__).parent / "vectors" / "client_capabilities.json").read_text())
    missing = []
    for entry in listed["module"]:
        module, name = entry["python"].split(":")
        if not hasattr(importlib.import_module(module), name):
            missing.append(entry["python"])
    client = RealtimeClient("ws://127.0.0.1:1/realtime/")
    for entry in listed["methods"]:
        method = getattr(client, entry["python"], None)
        if not callable(method):
            missing.append(f"RealtimeClient.{entry['python']}()")
        elif "argument" in entry and entry["argument"]["python"] not in inspect.signature(method).parameters:
            missing.append(f"RealtimeClient.{entry['python']}({entry['argument']['python']})")
    missing += [f"RealtimeClient.{e['python']}" for e in listed["attributes"] if not hasattr(client, e["python"])]
    for entry in listed["options"]:
        method, option = entry["python"].split(":")
        if option not in inspect.signature(getattr(client, method)).parameters:
            missing.append(f"RealtimeClient.{method}({option}=)")
    for entry in listed["events"]:
        owner, _, name = entry["python"].rpartition(".")
        holder = inspect.getsource(AdaptiveChannel.__init__) if owner else None
        if (holder is not None and f"self.{name}" not in holder) or (
            holder is None and not isinstance(getattr(client, name, None), list)
        ):
            missing.append(entry["python"])
    assert missing == []


async def test_reconnect_drops_the_connection_and_opens_a_new_one_after_the_delay(server):
    frames: list[dict] = []
    closes: list[tuple] = []
    client = RealtimeClient(server.ws)
    client.on_close.append(lambda code, reason, again: closes.append((code, again)))
    await client.connect()
    try:
        await client.subscribe("demo:clock:100", frames.append)
        await eventually(lambda: len(frames) >= 2)
        await client.reconnect(300)
        await eventually(lambda: closes, 10, "the blip's close")
        [(code, again)] = closes
        assert again and not is_reconnectable_close_code(code)  # a clean close, and a reconnect all the same
        count = len(frames)
        await eventually(lambda: client.state == "open" and len(frames) >= count + 3, 10, "open again, resubscribed")
        assert client.attempt == 0
    finally:
        await client.close()


async def test_a_refusal_the_application_caught_is_not_logged(server, caplog):
    caplog.set_level(logging.DEBUG, logger="realtime_app")
    async with RealtimeClient(server.ws) as client:
        with pytest.raises(RPCError):
            await client.subscribe("atelier:load", lambda params: None)  # anonymous: forbidden
    assert [r.getMessage() for r in caplog.records if "refused" in r.getMessage()] == []


async def test_a_client_without_origin_is_refused_and_the_documented_origin_is_let_in(server):
    """docs/protocol.md, "The handshake: Origin": what a non-browser client must send."""
    import websockets

    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(server.ws, open_timeout=10):
            pass
    assert refused.value.response.status_code == 403
    async with websockets.connect(server.ws, origin=server.http, open_timeout=10) as ws:  # the site's own origin
        await ws.send(json.dumps({"jsonrpc": "2.0", "method": "ping", "id": 1}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 10))["result"] == "pong"
    async with RealtimeClient(server.ws) as client:  # the Python client sends it by default
        assert client.origin == server.http and await client.call("ping") == "pong"


async def test_unsubscribing_a_cadence_the_server_moved_leaves_the_one_it_subscribed():
    """Past the cadence cap the server subscribes the nearest running cadence: leaving
    must leave that one (the client used to name the one it asked for, and the server,
    finding no such subscription, kept the other until the connection closed)."""
    server = Server({"REDIS_URL": "", "REALTIME_TEST_OVERRIDES": json.dumps({"MAX_CADENCES_PER_FAMILY": 1})}).start()
    try:
        async with RealtimeClient(server.ws) as first, RealtimeClient(server.ws) as second:
            await first.subscribe("demo:clock:300", lambda params: None)
            moved = await second.subscribe("demo:clock:700", lambda params: None)
            assert moved["channel"] == "demo:clock:300"  # the nearest running cadence
            answer = await second.unsubscribe("demo:clock:700")
            assert answer == {"channel": "demo:clock:300", "unsubscribed": True}
    finally:
        server.stop()


async def test_a_delta_subscription_rebuilds_every_publication_across_a_reconnect(server):
    """The Python client applies deltas (docs/protocol.md, "Deltas"): what its handler gets
    equals what a plain subscriber gets, seq by seq, before and after a reconnect."""
    from tests.support.wsclient import RPC

    channel = "test:state-dropped"  # 2 KB, one field changing per publication
    got: dict[int, str] = {}
    kinds: list[bool] = []

    def take(params):
        got[params["seq"]] = digest(params["data"])
        kinds.append(params["delta"])

    async def publish(rpc, count):
        answer = await rpc.call("test.publish_burst", {"channels": [channel], "count": count, "size": 2000})
        assert answer["result"] == count

    async with RPC(server.ws) as plain, RPC(server.ws) as publisher, RealtimeClient(server.ws) as client:
        await plain.subscribe(channel)
        answer = await client.subscribe(channel, take, delta="fossil")
        assert answer["delta"] == "fossil"
        await publish(publisher, 10)
        await eventually(lambda: len(got) >= 10, 10, "frames before the reconnect")
        await client.reconnect(100)
        await eventually(lambda: client.state == "open" and client.attempt == 0, 15, "open again")
        await eventually(lambda: channel in client.session.deltas, 10, "subscribed again")
        await publish(publisher, 10)
        await eventually(lambda: len(got) >= 20, 15, "frames after the reconnect")
        expected = {f["seq"]: digest(f["data"]) for f in await plain.frames(20)}
    assert got == expected  # every publication, exactly
    # a full frame first; after the reconnect the current value, whole, at once (its seq seen
    # before), and it is the base of the next delta: 21 frames for 20 publications. The rest
    # are deltas, except that a loaded machine may send one whole (the delta search is
    # bounded in time, docs/performance.md): correct, only larger.
    assert len(kinds) == 21 and kinds[0] is False and kinds[10] is False
    assert kinds.count(True) >= 17, kinds


async def test_a_delta_subscription_of_a_channel_with_history_rebuilds_every_publication_across_a_resume(server):
    """Deltas on a channel with history: what was published while the client was away comes
    back whole by the resume, then deltas go on; every publication is rebuilt exactly."""
    from tests.support.wsclient import RPC

    channel = "test:big-history"
    got: dict[int, str] = {}
    kinds: dict[int, bool] = {}
    recovered: list[int] = []

    def take(params):
        got[params["seq"]] = digest(params["data"])
        kinds[params["seq"]] = params["delta"]

    async def publish(rpc, count):
        answer = await rpc.call("test.publish_burst", {"channels": [channel], "count": count, "size": 2000})
        assert answer["result"] == count

    async with RPC(server.ws) as plain, RPC(server.ws) as publisher, RealtimeClient(server.ws) as client:
        client.on_recovered.append(lambda _channel, replayed: recovered.append(replayed))
        await plain.subscribe(channel)
        answer = await client.subscribe(channel, take, delta="fossil")
        assert answer["delta"] == "fossil"
        await publish(publisher, 10)
        await eventually(lambda: len(got) >= 10, 10, "frames before the reconnect")
        await client.reconnect(3000)
        await publish(publisher, 10)  # while it is away
        await eventually(lambda: recovered, 20, "the resume")
        await publish(publisher, 10)
        await eventually(lambda: len(got) >= 30, 15, "frames after the resume")
        # Frames published while the server still replays go whole (held behind the
        # replay): on a loaded machine that can be any of the ten above. Once all of
        # them arrived, the replay is long over: these are deltas.
        await publish(publisher, 5)
        await eventually(lambda: len(got) >= 35, 15, "frames well after the resume")
        expected = {f["seq"]: digest(f["data"]) for f in await plain.frames(35)}
    assert got == expected  # every publication, exactly
    seqs = sorted(got)
    assert sum(recovered) >= 10  # the ten published while it was away came by the resume
    assert not any(kinds[s] for s in seqs[10:20])  # replayed whole
    assert kinds[seqs[0]] is False and all(kinds[s] for s in seqs[1:10])  # a full frame, then deltas
    assert all(kinds[s] for s in seqs[30:])  # deltas again after the resume


@pytest.mark.timeout(180)
async def test_a_slow_delta_subscriber_rebuilds_every_frame_it_gets_across_drops():
    """A handler slower than its connection's frames: the server drops frames for it, the
    frame after a drop is full, deltas go on once it reads again; every frame the handler
    gets is exactly the publication."""
    from tests.support.wsclient import RPC

    channel = "test:drift"  # 2 KiB of state, 200 characters new in each, 10 a second
    flood = "demo:flood:10"  # 32 KiB of random text 100 times a second on the same connection
    server = Server(
        {
            "REDIS_URL": "",
            "REALTIME_DEMO_FLOOD": "1",
            "REALTIME_MAX_BACKPRESSURE": str(128 * 1024),
            "REALTIME_CLOSE_AFTER_DROPS": "100000",
        }
    ).start()
    got: dict[int, str] = {}
    kinds: dict[int, bool] = {}

    slowing = asyncio.Event()
    slowing.set()

    async def slow(params):
        if params["channel"] == channel:
            got[params["seq"]] = digest(params["data"])
            kinds[params["seq"]] = params["delta"]
        if slowing.is_set():
            await asyncio.sleep(0.05)  # 20 frames a second: the flood comes at 100

    def gaps() -> list[int]:  # the first seq after each run of frames the server dropped
        seqs = sorted(got)
        return [b for a, b in zip(seqs, seqs[1:], strict=False) if b - a > 1]

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's queue fills
    sock.connect(("127.0.0.1", server.port))
    try:
        async with RPC(server.ws) as plain, RealtimeClient(server.ws, sock=sock, max_queue=1) as client:
            await plain.subscribe(channel)
            expected: dict[int, str] = {}

            async def read_plain() -> None:  # the reference, read as fast as it comes: nothing dropped
                while True:
                    [frame] = await plain.frames(1, timeout=30)
                    expected[frame["seq"]] = digest(frame["data"])

            reader = asyncio.get_running_loop().create_task(read_plain())
            await client.subscribe(channel, slow, delta="fossil")
            await client.subscribe(flood, slow)
            try:
                await eventually(lambda: gaps(), 60, "frames dropped for the slow handler")
                slowing.clear()  # reading at full speed again
                await client.unsubscribe(flood)
                await eventually(lambda: len([s for s in got if s > gaps()[-1]]) >= 5, 30, "deltas again")
                await eventually(lambda: expected and max(expected) >= max(got), 20, "the reference caught up")
            finally:
                slowing.clear()  # the close is not stuck behind a full queue
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
        seqs = sorted(got)
        common = [s for s in seqs if s in expected]
        # (the reference reads fast, but on a loaded machine the guard may drop for it too)
        assert len(common) >= len(seqs) // 2 and all(got[s] == expected[s] for s in common)
        full = {s for s in seqs if not kinds[s]}
        assert set(gaps()) <= full  # a full frame after each drop
        assert any(kinds[s] for s in seqs if s > gaps()[-1])  # then deltas again
    finally:
        server.stop()


async def test_the_command_line_client_says_closed_once(server):
    """Found: ``python -m realtime_app.client`` printed ``# closed`` twice at its end."""
    import subprocess
    import sys

    from tests.support.servers import ROOT

    command = [sys.executable, "-m", "realtime_app.client", server.ws, "demo:clock:100", "--count", "3"]
    done = await asyncio.to_thread(subprocess.run, command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 3
    assert [line for line in done.stderr.splitlines() if line.startswith("# ") and "{" not in line] == [
        "# connecting",
        "# open",
        "# closed",
    ], done.stderr


async def test_a_delta_that_does_not_apply_makes_the_client_subscribe_again_for_a_full_frame(server, caplog):
    """The resubscribe on a broken chain (no test broke one): a base that is not the one
    the server built against is never patched; the client subscribes again once, gets a
    full frame, and its handler goes on with exactly what a plain subscriber gets."""
    from tests.support.wsclient import RPC

    channel = "test:state-dropped"
    got: dict[int, str] = {}

    async def publish(rpc, count, start):
        burst = {"channels": [channel], "count": count, "size": 2000, "start": start}
        assert (await rpc.call("test.publish_burst", burst))["result"] == count

    async with RPC(server.ws) as plain, RPC(server.ws) as publisher, RealtimeClient(server.ws) as client:
        await plain.subscribe(channel)
        await client.subscribe(
            channel, lambda params: got.__setitem__(params["seq"], digest(params["data"])), delta="fossil"
        )
        await publish(publisher, 3, 0)
        await eventually(lambda: len(got) >= 3, 10, "the first frames")
        client.session.deltas.bases[channel] = b'{"n": 0, "pad": "not what the server holds"}'  # a broken chain
        with caplog.at_level(logging.WARNING, "realtime_app.client"):
            await publish(publisher, 1, 3)  # a delta against the real base: it cannot apply here
            await eventually(lambda: any("subscribing again" in r.getMessage() for r in caplog.records), 10, "again")
            sent = 4

            async def delivered_again() -> bool:  # a publication at a time until one gets through
                nonlocal sent
                await publish(publisher, 1, sent)
                sent += 1
                return len(got) > 3

            await eventually(delivered_again, 15, "a full frame after the subscribe again")
            before = len(got)
            await publish(publisher, 3, sent)  # and deltas on the new base
            sent += 3
            await eventually(lambda: len(got) >= before + 3, 10, "deltas again")
        expected = {f["seq"]: digest(f["data"]) for f in await plain.frames(sent)}
    assert all(got[seq] == expected[seq] for seq in got)  # nothing patched onto the wrong base
    assert len([r for r in caplog.records if "subscribing again" in r.getMessage()]) == 1


async def test_a_call_in_flight_fails_at_once_with_outcome_unknown_when_the_client_closes(server):
    """Found in review: close() stopped the socket's loop before it heard the close, and a
    call in flight waited for its whole timeout."""
    from realtime_app.exceptions import OutcomeUnknown

    client = RealtimeClient(server.ws)
    await client.connect()
    call = asyncio.ensure_future(client.call("test.sleep", {"seconds": 30}, timeout=60))
    await eventually(lambda: bool(client.session.in_flight), 5, "the call sent")
    await client.close()
    with pytest.raises(OutcomeUnknown, match="outcome unknown"):
        await asyncio.wait_for(call, 5)


async def test_a_call_lost_while_it_is_sent_leaves_no_unretrieved_error():
    """Found by bench/deploy.py: a connection closed (1012) while a call's frame was being
    written settled the call's answer with OutcomeUnknown that nobody read, and asyncio
    logged "Future exception was never retrieved" for each: the caller has the send's
    error, and nothing else is left behind."""
    import gc

    from realtime_app.client import RealtimeClient

    client = RealtimeClient("ws://127.0.0.1:9/realtime/")
    loop = asyncio.get_running_loop()
    unretrieved: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))

    async def send(text: str) -> None:
        client._lost(1012)  # the connection ends while the frame is written
        raise ConnectionError("connection lost")

    client.socket.ws = object()  # open, as far as the call can tell
    client.socket.send = send  # type: ignore[method-assign]
    try:
        with pytest.raises(ConnectionError):
            await client.call("ping")
        gc.collect()  # an unretrieved exception is reported as its future is collected
        assert not unretrieved, unretrieved
    finally:
        loop.set_exception_handler(previous)


class FlakyServer:
    """A JSON-RPC endpoint of its own: the first ``refused_handshakes`` handshakes answered
    503, then the first connection closed with 1013 when it asks ``subscribe``, the next
    ones answered; counts the subscribes each connection got."""

    def __init__(self, refused_handshakes: int = 0, close_first: bool = True) -> None:
        self.refused_handshakes, self.close_first = refused_handshakes, close_first
        self.subscribes: list[list[str]] = []

    def process_request(self, connection, request):
        if self.refused_handshakes > 0:
            self.refused_handshakes -= 1
            return connection.respond(503, "busy\n")
        return None

    async def handler(self, ws) -> None:
        mine: list[str] = []
        self.subscribes.append(mine)
        async for text in ws:
            request = json.loads(text)
            if request.get("method") == "subscribe":
                mine.append(request["params"]["channel"])
                if self.close_first and len(self.subscribes) == 1:
                    await ws.close(1013, "try again later")
                    return
                result = {"channel": request["params"]["channel"], "kind": "event", "interval_ms": None}
                await ws.send(json.dumps({"jsonrpc": "2.0", "id": request["id"], "result": result}))


@pytest.mark.parametrize("refused_handshakes", [0, 2])
async def test_a_subscribe_in_flight_when_the_server_says_1013_waits_for_the_reconnect(refused_handshakes):
    """Found: a ``subscribe()`` whose connection was closed with 1013 (or whose handshake was
    refused, which the client takes as 1013) raised, and forgot the channel, while the client
    was about to reconnect. It now waits: the renewal the next connection makes is its
    answer, sent once."""
    from websockets.asyncio.server import serve

    fake = FlakyServer(refused_handshakes=refused_handshakes, close_first=not refused_handshakes)
    async with serve(fake.handler, "127.0.0.1", 0, process_request=fake.process_request) as server:
        port = server.sockets[0].getsockname()[1]
        # a call timeout shorter than the handshakes' backoff: waiting for it is no timeout
        client = RealtimeClient(f"ws://127.0.0.1:{port}/", call_timeout=0.2, backoff_initial=0.3, backoff_max=0.4)
        client.socket.start()
        try:
            answer = await asyncio.wait_for(client.subscribe("orders", lambda params: None), 10)
            assert answer["channel"] == "orders" and "orders" in client.session.handlers
            assert fake.subscribes[-1] == ["orders"]  # the renewal: asked once on the new connection
        finally:
            await client.close()


@contextlib.asynccontextmanager
async def answering(handler, process_request, closes: list[tuple]):
    """A plain ``websockets`` server answering each handshake with ``process_request`` (an
    HTTP answer, or None to let it in) and a client of it recording ``(code, again)`` of
    every close in ``closes``; the client is closed on the way out."""
    import websockets

    async with websockets.serve(handler, "127.0.0.1", 0, process_request=process_request) as served:
        port = served.sockets[0].getsockname()[1]
        client = RealtimeClient(f"ws://127.0.0.1:{port}/", backoff_initial=0.05, backoff_max=0.2)
        client.on_close.append(lambda c, r, again: closes.append((c, again)))
        try:
            yield client
        finally:
            await client.close()


def in_turn(answers: list[int], body: str):
    """A ``process_request`` answering each handshake with the next of ``answers`` (and
    ``body``) while there is one, then letting it in."""
    return lambda connection, request: connection.respond(answers.pop(0), body) if answers else None


async def held_open(ws) -> None:
    await ws.wait_closed()


@pytest.mark.parametrize("statuses", [[502, 504, 500], [503, 429]])
async def test_a_handshake_refused_by_a_proxy_or_a_busy_server_is_tried_again(statuses):
    """Found (a rolling restart of 4,500 clients behind nginx): an HTTP 5xx answer to the
    handshake closed the Python client for good (4502, 4504…) where the browser's comes
    back: both clients now read a refused handshake with one rule (``refusal_of``)."""
    answers = list(statuses)
    closes: list[tuple] = []
    async with answering(held_open, in_turn(answers, "upstream unavailable\n"), closes) as client:
        opened = asyncio.ensure_future(client.connect())
        await eventually(lambda: client.state == "open", 15, "the client back once the server answers")
        await asyncio.wait_for(opened, 15)
        assert [again for _, again in closes] == [True] * len(statuses) and not answers


@pytest.mark.parametrize(("status", "code", "again"), [(403, 1008, 2), (401, 4002, 0)])
async def test_a_handshake_refused_for_its_origin_or_token_stays_closed(status, code, again):
    """A refused token at once; a refused origin on the third 403 in a row (a first or
    second is daphne's too, to a handshake not accepted in time: the test below)."""
    closes: list[tuple] = []

    async def handler(ws):  # pragma: no cover - never reached
        await ws.wait_closed()

    refuse = lambda connection, request: connection.respond(status, "refused\n")  # noqa: E731
    async with answering(handler, refuse, closes) as client:
        with pytest.raises(ConnectionRefusedError, match=f"closed for good \\({code}\\)"):
            await client.connect(timeout=20)  # at once: not after the timeout, as a TimeoutError
        assert closes == [(1006, True)] * again + [(code, False)] and client.state == "closed"


async def test_a_new_client_answered_403_by_a_server_too_busy_to_accept_in_time_comes_in():
    """Found (a drained deploy of 4,500 clients whose processes took 100 anonymous
    handshakes a second): 14 new clients whose first handshake daphne answered 403 — its
    application had not accepted within ``--websocket_connect_timeout`` — took it as a
    refused origin and never connected."""
    closes: list[tuple] = []
    async with answering(held_open, in_turn([403, 403], "Access denied\n"), closes) as client:
        await client.connect(timeout=15)
        assert closes == [(1006, True), (1006, True)] and client.state == "open"


async def test_the_403s_in_a_row_are_counted_afresh_when_a_client_connects_again():
    """Three 403s stop the client; connected again, its 403s count from none (a client
    refused once is not refused at its next first 403), and any other end in between
    (here a 500) starts the row again."""
    answers = [403, 403, 403]
    closes: list[tuple] = []
    async with answering(held_open, in_turn(answers, "Access denied\n"), closes) as client:
        with pytest.raises(ConnectionRefusedError, match="closed for good \\(1008\\)"):
            await client.connect(timeout=15)
        answers.extend([403, 403, 500, 403, 403])
        closes.clear()
        await client.connect(timeout=15)
        assert [code for code, _ in closes] == [1006, 1006, 1013, 1006, 1006] and client.state == "open"


async def test_a_403_to_a_client_the_server_let_in_before_is_tried_again():
    """Found (a rolling restart at once, 4,500 clients): daphne answers 403 to a handshake
    its application has not accepted within ``--websocket_connect_timeout`` — the returning
    crowd's — and 208 clients took it as a refused origin and stopped for good."""
    refusals = [0]  # 403s still to answer; the first handshake is let in
    closes: list[tuple] = []

    def process_request(connection, request):
        if refusals[0]:
            refusals[0] -= 1
            return connection.respond(403, "Access denied\n")
        return None

    async def handler(ws):
        if not closes:  # the first connection: dropped as a restarting server does
            refusals[0] = 2
            await ws.close(1012, "restart")
        else:
            await ws.wait_closed()

    async with answering(handler, process_request, closes) as client:
        await client.connect(timeout=15)
        await eventually(lambda: len(closes) == 3 and client.state == "open", 15, "back after two 403s")
        assert closes == [(1012, True), (1006, True), (1006, True)] and refusals[0] == 0


async def test_a_drains_reconnect_ticket_is_shown_until_a_connection_is_served():
    """The Python twin of tests/js/client.test.mjs: the ticket of a drain's 1012 goes on
    the next handshakes, past a refusal that accepts and closes (1013, no frame), and is
    dropped once a connection is served (a frame came)."""
    paths: list[str] = []
    closes: list[tuple] = []

    def process_request(connection, request):
        paths.append(request.path)
        return None

    async def handler(ws):
        n = len(paths)
        if n == 1:
            await ws.close(1012, "retry_after_ms=1 ticket=n0nce:1x:S1g-_")  # drained
        elif n == 2:
            await ws.close(1013, "too many handshakes")  # refused after the accept: no frame
        elif n == 3:
            await ws.send('{"jsonrpc": "2.0", "method": "ping"}')  # served
            await ws.close(1013, "later")
        else:
            await ws.wait_closed()

    async with answering(handler, process_request, closes) as client:
        await client.connect(timeout=15)
        await eventually(lambda: len(paths) == 4, 15, "four handshakes")
        assert paths == ["/", "/?ticket=n0nce%3A1x%3AS1g-_", "/?ticket=n0nce%3A1x%3AS1g-_", "/"], paths
