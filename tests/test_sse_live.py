"""Server-Sent Events and JSON-RPC over HTTP, black-box on daphne and uvicorn processes of
the demo site (SPEC §13): ``GET /realtime/sse`` with the socket's rules, ids that resume,
resyncs said, heartbeats, the socket's caps and guard; ``POST /realtime/rpc`` with the
socket's methods and admission, CSRF for session requests only.

Found: WebSocket was the only way in — a page behind a proxy that breaks WebSockets, or an
htmx page (``hx-ext="sse"``), had nothing."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.health import Probe
from tests.support.servers import Server, login, logout, manage
from tests.support.sse import SseStream, rpc
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(120)

OVERRIDES = {"HEARTBEAT_SECONDS": 1, "REVALIDATE_INTERVAL_MS": 1000}


def start(database, server="daphne", overrides=None, **env):
    environment = {
        **database,
        "REDIS_URL": "",
        "REALTIME_TEST_OVERRIDES": json.dumps({**OVERRIDES, **(overrides or {})}),
        **env,
    }
    if server == "uvicorn-h11":  # uvicorn's other HTTP implementation
        return Server(environment, server="uvicorn", extra_args=["--http", "h11"]).start()
    return Server(environment, server=server).start()


@pytest.fixture(scope="module", params=["daphne", "uvicorn", "uvicorn-h11"])
def site(request, database):
    server = start(database, request.param)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def daphne(database):
    server = start(database)
    yield server
    server.stop()


async def publish(port, channel, data, **headers):
    status, body = await rpc(
        port, {"jsonrpc": "2.0", "method": "publish", "params": {"channel": channel, "data": data}, "id": 1}, headers
    )
    assert status == 200 and "result" in body, body
    return body["result"]["seq"]


async def test_refusals_answer_before_the_stream_with_the_json_rpc_error(site):
    unknown = await SseStream(site.port, ["no:such:channel"]).open()
    assert unknown.status == 404
    assert unknown.json()["error"]["code"] == -32002 and unknown.json()["error"]["data"]["channel"] == "no:such:channel"
    forbidden = await SseStream(site.port, ["demo:events", "atelier:load"]).open()  # one refused: none served
    assert forbidden.status == 403 and forbidden.json()["error"]["code"] == -32001
    assert forbidden.json()["error"]["data"]["reason"] == "forbidden_channel"
    missing = await SseStream(site.port, []).open()
    assert missing.status == 400 and missing.json()["error"]["data"]["reason"] == "missing_channel"
    bad_token = await SseStream(site.port, ["demo:events"], {"Authorization": "Bearer not-a-token"}).open()
    assert bad_token.status == 401


async def test_a_stream_carries_each_publication_with_its_canonical_name_an_id_and_heartbeats(site):
    stream = await SseStream(site.port, ["demo:events", "demo:clock:250"]).open()
    try:
        assert stream.status == 200
        assert stream.response_headers["content-type"].startswith("text/event-stream")
        answers = [await stream.read_until(lambda e: e.get("event") == "realtime.subscribed", what="answers")]
        answers.append(await stream.read_until(lambda e: len(stream.named("realtime.subscribed")) == 2 or None))
        answers = [e["json"] for e in stream.named("realtime.subscribed")]
        assert [a["channel"] for a in answers] == ["demo:events", "demo:clock:250"]
        seq = await publish(site.port, "demo:events", {"hello": "sse"})
        event = await stream.read_until(lambda e: e.get("event") == "demo:events", what="the publication")
        assert event["json"]["channel"] == "demo:events" and event["json"]["data"] == {"hello": "sse"}
        assert event["json"]["seq"] == seq and isinstance(event["json"]["epoch"], str)
        assert json.loads(event["id"])["demo:events"] == [seq, event["json"]["epoch"]]
        tick = await stream.read_until(lambda e: e.get("event") == "demo:clock:250", what="a tick")
        assert set(tick["json"]) >= {"channel", "seq", "data"}
        await stream.read_until(lambda e: "comment" in e, 5, "a heartbeat comment")
    finally:
        stream.close()


async def test_last_event_id_resumes_what_was_missed_once_in_order(site):
    first = await SseStream(site.port, ["demo:events"]).open()
    seqs = [await publish(site.port, "demo:events", {"n": n}) for n in range(3)]
    last = await first.read_until(lambda e: e.get("event") == "demo:events" and e["json"]["seq"] == seqs[-1])
    first.close()
    missed = [await publish(site.port, "demo:events", {"n": n}) for n in range(3, 7)]
    again = await SseStream(site.port, ["demo:events"], {"Last-Event-ID": last["id"]}).open()
    try:
        await again.read_until(lambda e: e.get("event") == "realtime.subscribed")
        answer = again.named("realtime.subscribed")[0]["json"]
        assert answer["recovered"] is True and answer["replayed"] == 4
        live = await publish(site.port, "demo:events", {"n": "live"})
        await again.read_until(lambda e: e.get("event") == "demo:events" and e["json"]["seq"] == live)
        assert [e["json"]["seq"] for e in again.publications()] == [*missed, live]  # once each, in order
    finally:
        again.close()
    # a page's EventSource cannot set the header: the query parameter does the same
    by_query = await SseStream(site.port, ["demo:events"], query=f"last_event_id={_quote(last['id'])}").open()
    try:
        await by_query.read_until(lambda e: e.get("event") == "demo:events" and e["json"]["seq"] == live)
        assert [e["json"]["seq"] for e in by_query.publications()] == [*missed, live]
    finally:
        by_query.close()


def _quote(text):
    import urllib.parse

    return urllib.parse.quote(text)


async def test_a_gap_history_cannot_fill_is_an_explicit_resync_event(daphne):
    await publish(daphne.port, "demo:events", {"n": 1})
    stale = json.dumps({"demo:events": [3, "0000000000000000000"]})  # an epoch long replaced
    stream = await SseStream(daphne.port, ["demo:events"], {"Last-Event-ID": stale}).open()
    try:
        resync = await stream.read_until(lambda e: e.get("event") == "realtime.resync", what="the resync")
        assert resync["json"]["channel"] == "demo:events" and resync["json"]["reason"]
        answer = (await stream.read_until(lambda e: e.get("event") == "realtime.subscribed"))["json"]
        assert answer["recovered"] is False
        seq = await publish(daphne.port, "demo:events", {"n": 2})
        event = await stream.read_until(lambda e: e.get("event") == "demo:events")
        assert event["json"]["seq"] == seq and json.loads(event["id"])["demo:events"][0] == seq
    finally:
        stream.close()


async def test_session_cookie_and_bearer_token_sign_a_stream_in_and_logout_ends_it(daphne, database):
    cookie = login(daphne.http, "demo", "demo")
    session = await SseStream(daphne.port, ["atelier:load:250"], {"Cookie": cookie}).open()
    token = manage(database, "realtime_token", "demo")
    bearer = await SseStream(daphne.port, ["atelier:load:250"], {"Authorization": f"Bearer {token}"}).open()
    try:
        assert session.status == 200 and bearer.status == 200
        await session.read_until(lambda e: e.get("event") == "atelier:load:250", what="a load frame")
        await bearer.read_until(lambda e: e.get("event") == "atelier:load:250", what="a load frame")
        assert logout(daphne.http, cookie) in (200, 302)
        final = await session.read_until(lambda e: e.get("event") == "realtime.close", 10, "the final event")
        assert final["json"]["code"] == 4001
        await session.read_to_end(10)
        assert session.ended
        # the token's stream is not the session's: it goes on
        count = len(bearer.publications())
        await bearer.read_until(lambda e: len(bearer.publications()) > count + 1, what="more frames")
    finally:
        session.close()
        bearer.close()


async def test_connection_caps_count_streams_with_sockets(database):
    server = start(database, overrides={"MAX_CONNECTIONS_PER_ADDRESS": 2})
    streams = []
    try:
        for _ in range(2):
            streams.append(await SseStream(server.port, ["demo:clock:1000"]).open())
            assert streams[-1].status == 200
        third = await SseStream(server.port, ["demo:clock:1000"]).open()
        assert third.status == 429 and third.json()["error"]["data"]["close_code"] == 1008
        streams[0].close()
        await eventually(lambda: Probe(server).read()["connections"] == 1, 10, "the closed stream released")
        streams.append(await SseStream(server.port, ["demo:clock:1000"]).open())
        assert streams[-1].status == 200
    finally:
        for stream in streams:
            stream.close()
        server.stop()


@pytest.mark.parametrize("server_kind", ["daphne", "uvicorn", "uvicorn-h11"])
async def test_a_stream_that_stops_reading_is_bounded_then_closed_with_a_final_event(database, server_kind):
    limit = 1024 * 1024
    server = start(
        database,
        server_kind,
        REALTIME_DEMO_FLOOD="1",
        REALTIME_MAX_BACKPRESSURE=str(limit),
        REALTIME_CLOSE_AFTER_DROPS="200",
        REALTIME_SLOW_CONSUMER_BYTES=str(limit // 2),
    )
    slow = SseStream(server.port, ["demo:flood:10"])
    try:
        probe = Probe(server)
        await slow.open()
        assert slow.status == 200
        slow.pause()
        samples: list = []
        await probe.until(lambda t: t["drops"] > 50, 30, "frames dropped", seen=samples)
        worst = max(s["max_buffered_amount"] for s in samples)
        assert worst <= limit + 48 * 1024  # the guard bounds a stream's queue as a socket's
        closed = await probe.until(lambda t: t["closes"] == 1, 30, "the close")
        assert closed["connections"] == 0
        slow.resume()
        events = await slow.read_to_end(30)
        final = [e for e in events if e.get("event") == "realtime.close"]
        assert final and final[-1]["json"] == {"code": 1013, "reason": "backpressure"}
        assert events[-1] is final[-1]  # the last word
    finally:
        slow.close()
        server.stop()


async def test_json_rpc_over_http_runs_the_sockets_methods_with_csrf_for_sessions_only(daphne, database):
    batch = [
        {"jsonrpc": "2.0", "method": "ping", "id": 1},
        {"jsonrpc": "2.0", "method": "publish", "params": {"channel": "demo:events", "data": 1}, "id": 2},
        {"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": "demo:events"}, "id": 3},
        {"jsonrpc": "2.0", "method": "nope", "id": 4},
    ]
    status, answers = await rpc(daphne.port, batch)
    assert status == 200 and [a["id"] for a in answers] == [1, 2, 3, 4]
    assert answers[0]["result"] == "pong" and answers[1]["result"]["channel"] == "demo:events"
    assert answers[2]["error"]["data"]["reason"] == "stream_only"
    assert answers[3]["error"]["code"] == -32601
    status, body = await rpc(daphne.port, {"jsonrpc": "2.0", "method": "ping"})  # a notification
    assert status == 204 and body is None
    status, body = await rpc(daphne.port, b"{not json")
    assert status == 200 and body["error"]["code"] == -32700
    status, body = await rpc(daphne.port, b"[" + b"1," * 40_000 + b"1]")
    assert status == 413
    cookie = login(daphne.http, "demo", "demo")
    csrf = dict(part.split("=", 1) for part in cookie.split("; "))["csrftoken"]
    ping = {"jsonrpc": "2.0", "method": "ping", "id": 9}
    status, body = await rpc(daphne.port, ping, {"Cookie": cookie})
    assert status == 403 and body["error"]["data"]["reason"] == "csrf_failed"
    origin = f"http://127.0.0.1:{daphne.port}"
    status, body = await rpc(daphne.port, ping, {"Cookie": cookie, "X-CSRFToken": csrf, "Origin": origin})
    assert status == 200 and body["result"] == "pong"
    token = manage(database, "realtime_token", "demo")
    status, body = await rpc(daphne.port, ping, {"Authorization": f"Bearer {token}"})
    assert status == 200 and body["result"] == "pong"


async def test_http_rpc_costs_the_callers_tokens_like_a_socket(database):
    server = start(database, overrides={"ADMISSION_BUCKET_CAPACITY": 5, "ADMISSION_REFILL_PER_S": 0.5})
    try:
        answers = []
        for _ in range(4):
            calls = [_publish_call(i) for i in range(3)]
            status, body = await rpc(server.port, calls)
            answers += body if isinstance(body, list) else [body]
        refused = [a for a in answers if "error" in a]
        assert refused and refused[0]["error"]["data"]["reason"] == "rate_limited"
        assert refused[0]["error"]["data"]["retry_after_ms"] > 0
    finally:
        server.stop()


def _publish_call(i):
    return {"jsonrpc": "2.0", "method": "publish", "params": {"channel": "demo:events", "data": i}, "id": i}


async def test_a_drain_ends_streams_with_the_restart_code(database):
    server = start(database, overrides={"DRAIN_SECONDS": 1})
    stream = await SseStream(server.port, ["demo:clock:1000"]).open()
    try:
        await stream.read_until(lambda e: e.get("event") == "realtime.subscribed")
        server.process.terminate()
        final = await stream.read_until(lambda e: e.get("event") == "realtime.close", 15, "the final event")
        assert final["json"]["code"] == 1012 and "retry_after_ms=" in final["json"]["reason"]
        await asyncio.to_thread(server.process.wait, 15)
    finally:
        stream.close()
        server.stop()


async def test_a_dropped_frame_of_a_channel_with_history_ends_the_stream_and_the_reconnect_fills_the_gap(database):
    key = "sse-test-key"
    server = start(
        database,
        REALTIME_MAX_BACKPRESSURE=str(64 * 1024),
        REALTIME_PUBLISH_API_KEYS=key,
        REALTIME_CLOSE_AFTER_DROPS="1000000",
    )
    slow = SseStream(server.port, ["demo:events"])
    try:
        await slow.open()
        await slow.read_until(lambda e: e.get("event") == "realtime.subscribed")
        slow.pause()
        blob = "x" * 3500
        sent = []
        for batch in range(9):  # ~3 MB of publications while the client reads nothing (within the history)
            publications = [
                {"channel": "demo:events", "data": {"n": batch * 100 + i, "blob": blob}} for i in range(100)
            ]
            status, body = await _publish_api(server.port, key, {"publications": publications})
            assert status == 202, body
            sent += [r["seq"] for r in body["results"]]
        slow.resume()
        events = await slow.read_to_end(30)
        assert events[-1].get("event") == "realtime.close" and events[-1]["json"]["code"] == 1013
        got = [e["json"]["seq"] for e in slow.publications()]
        assert got == list(range(got[0], got[0] + len(got))) and len(got) < len(sent)  # no gap: it ended at the drop
        again = SseStream(server.port, ["demo:events"], {"Last-Event-ID": slow.publications()[-1]["id"]})
        try:
            await again.open()
            await again.read_until(lambda e: e.get("event") == "demo:events" and e["json"]["seq"] == sent[-1], 30)
            assert got + [e["json"]["seq"] for e in again.publications()] == sent  # every one once, in order
        finally:
            again.close()
    finally:
        slow.close()
        server.stop()


async def _publish_api(port, key, body):
    import urllib.request

    def post():
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/realtime/api/publish",
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())

    return await asyncio.to_thread(post)


async def test_an_idempotent_call_runs_once_whatever_the_transport_it_is_sent_again_on(daphne, database):
    import websockets

    token = manage(database, "realtime_token", "demo")
    bearer = {"Authorization": f"Bearer {token}"}
    call = {
        "jsonrpc": "2.0",
        "method": "demo.post",
        "params": {"room": "sse-idem", "text": "once", "idempotency_key": "k-sse-1"},
        "id": 1,
    }
    status, first = await rpc(daphne.port, call, bearer)
    assert status == 200 and "result" in first, first
    status, again = await rpc(daphne.port, call, bearer)
    async with websockets.connect(daphne.ws, additional_headers=bearer) as ws:
        await ws.send(json.dumps(call))
        over_socket = json.loads(await ws.recv())
    assert again["result"] == first["result"] == over_socket["result"]  # one message saved, one answer


async def test_a_stream_whose_right_is_revoked_is_ended_by_the_revalidation(database):
    server = start(database)
    try:
        cookie = login(server.http, "admin", "admin")
        stream = await SseStream(server.port, ["test:staff"], {"Cookie": cookie}).open()
        assert stream.status == 200
        await stream.read_until(lambda e: e.get("event") == "realtime.subscribed")
        manage(
            database,
            "shell",
            "-c",
            "from django.contrib.auth.models import User; User.objects.filter(username='admin').update(is_staff=False)",
        )
        final = await stream.read_until(lambda e: e.get("event") == "realtime.close", 15, "the final event")
        assert final["json"]["code"] == 4003
        again = await SseStream(server.port, ["test:staff"], {"Cookie": cookie}).open()
        assert again.status == 403
        stream.close()
    finally:
        manage(
            database,
            "shell",
            "-c",
            "from django.contrib.auth.models import User; User.objects.filter(username='admin').update(is_staff=True)",
        )
        server.stop()


async def test_a_stream_of_many_channels_holds_one_admission_slot_at_a_time(daphne):
    """Found: every channel's admission was held until the stream started: past
    ADMISSION_MAX_PER_IDENTITY (10) channels a stream was always refused 429."""
    channels = ["demo:events", *(f"demo:clock:{ms}" for ms in range(100, 2000, 100))]
    stream = await SseStream(daphne.port, channels).open()
    try:
        assert stream.status == 200, stream.body
        await stream.read_until(lambda e: len(stream.named("realtime.subscribed")) == len(channels) or None)
    finally:
        stream.close()


async def test_notifications_over_http_run_before_the_answer(daphne, database):
    """Found: a notification to an application method was abandoned at the 204: it never ran."""
    bearer = {"Authorization": f"Bearer {manage(database, 'realtime_token', 'demo')}"}

    async def shots_left():
        status, body = await rpc(daphne.port, {"jsonrpc": "2.0", "method": "inventory.snapshot", "id": 1}, bearer)
        assert status == 200, body
        return body["result"]["items"]

    before = await shots_left()
    item = next(iter(before))
    fire = {"jsonrpc": "2.0", "method": "inventory.consume", "params": {"item": item, "shots": 1}}
    for _ in range(3):
        status, body = await rpc(daphne.port, fire, bearer)
        assert status == 204 and body is None
    assert (await shots_left())[item] == before[item] - 3


def _pipelined(port, path, count):
    import socket

    sock = socket.create_connection(("127.0.0.1", port))
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n".encode()
    sock.sendall(request * count)
    return sock


@pytest.mark.parametrize("server_kind", ["daphne", "uvicorn"])
async def test_streams_of_a_connection_gone_are_released_even_when_the_server_never_says(database, server_kind):
    """Found: under uvicorn a pipelined second request made the first stream deaf to the
    client's going: its connection stayed counted until a restart (429 for the address)."""
    server = start(database, server_kind)
    try:
        probe = Probe(server)
        sockets = [_pipelined(server.port, "/realtime/sse?channel=demo:clock", 2) for _ in range(5)]
        await eventually(lambda: probe.read()["connections"] >= 5, 10, "the streams open")
        for sock in sockets:
            sock.close()
        await eventually(lambda: probe.read()["connections"] == 0, 15, "every stream released")
        assert "Traceback" not in server.output()
    finally:
        server.stop()


async def test_a_client_gone_right_after_its_request_costs_no_traceback(daphne):
    import socket
    import struct

    for _ in range(10):
        sock = socket.create_connection(("127.0.0.1", daphne.port))
        sock.sendall(b"GET /realtime/sse?channel=demo:clock HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
        sock.close()
    stream = await SseStream(daphne.port, ["demo:clock"]).open()  # the process serves on, after them
    await stream.read_until(lambda e: e.get("event") == "realtime.subscribed")
    stream.close()
    log = daphne.output()
    assert "Exception inside application" not in log and "Traceback" not in log and "refusing event streams" not in log


async def test_bad_input_over_http_is_answered_and_logged_once_not_per_request(daphne):
    stream = await SseStream(daphne.port, ["demo:events"], {"Last-Event-ID": "[" * 8000 + "]" * 8000}).open()
    assert stream.status == 200  # an id that is none of ours reads as none
    stream.close()
    for _ in range(30):
        status, body = await rpc(daphne.port, b"{not json")
        assert status in (200, 429)
    lines = [line for line in daphne.output().splitlines() if "invalid_json" in line]
    assert len(lines) <= 2, lines  # one a minute with the count since (other tests of the module sent some too)


async def test_a_session_stream_from_another_sites_page_is_refused_and_csrf_failures_cost_tokens(daphne):
    cookie = login(daphne.http, "demo", "demo")
    evil = await SseStream(daphne.port, ["demo:events"], {"Cookie": cookie, "Origin": "http://evil.example"}).open()
    assert evil.status == 403 and evil.json()["error"]["data"]["reason"] == "origin_not_allowed"
    same = f"http://127.0.0.1:{daphne.port}"
    ok = await SseStream(daphne.port, ["demo:events"], {"Cookie": cookie, "Origin": same}).open()
    assert ok.status == 200
    ok.close()
    statuses = [(await rpc(daphne.port, {"jsonrpc": "2.0", "method": "ping", "id": 1}, {"Cookie": cookie}))[0]]
    statuses += [
        (await rpc(daphne.port, {"jsonrpc": "2.0", "method": "ping", "id": 1}, {"Cookie": cookie}))[0]
        for _ in range(40)
    ]
    assert statuses[0] == 403 and 429 in statuses  # a flood of forged calls is refused, not checked each time


async def test_a_position_given_under_the_name_asked_resumes_the_canonical_channel(database):
    """A client that knows a channel by the name it asked (``test:bids:01``) resumes it
    all the same: the stream's positions are the canonical names' (``test:bids:1``)."""
    key = "sse-test-key"
    server = start(database, REALTIME_PUBLISH_API_KEYS=key)
    try:

        async def publish_bid(n):
            status, body = await _publish_api(server.port, key, {"channel": "test:bids:1", "data": {"n": n}})
            assert status == 202, body
            return body["seq"]

        first = await SseStream(server.port, ["test:bids:01"]).open()
        answer = (await first.read_until(lambda e: e.get("event") == "realtime.subscribed"))["json"]
        assert answer["channel"] == "test:bids:1"
        seq = await publish_bid(0)
        await first.read_until(lambda e: e.get("event") == "test:bids:1")
        first.close()
        missed = [await publish_bid(n) for n in (1, 2)]
        since = json.dumps({"test:bids:01": [seq, answer["epoch"]]})
        again = await SseStream(server.port, ["test:bids:01"], {"Last-Event-ID": since}).open()
        try:
            await again.read_until(lambda e: len(again.publications()) == 2 or None)
            assert [e["json"]["seq"] for e in again.publications()] == missed
        finally:
            again.close()
    finally:
        server.stop()
