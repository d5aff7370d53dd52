"""The HTTP concurrency limiter on real servers: daphne and uvicorn (async path), gunicorn
with threads (sync path). Instrumented views count how many are inside at once."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any

import pytest

from tests.support.health import Probe
from tests.support.servers import Server
from tests.support.waiting import eventually, eventually_sync

pytestmark = pytest.mark.timeout(120)


def start(database: dict[str, str], server: str = "daphne", **pool: Any) -> Server:
    overrides = {}
    if pool:
        overrides["HTTP_POOLS"] = {"test": {"max_concurrent": 2, "max_waiting": 8, "wait_timeout_ms": 5000, **pool}}
    env = {**database, "REDIS_URL": "", "REALTIME_TEST_OVERRIDES": json.dumps(overrides)}
    return Server(env, server=server).start()


def get(
    server: Server, path: str, timeout: float = 30, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        connection.request("GET", path, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def stats(server: Server, reset: bool = False) -> dict[str, Any]:
    return json.loads(get(server, "/test/limited-stats/" + ("?reset=1" if reset else ""))[2])


def seen(pool: dict[str, Any]) -> int:
    """Requests the pool has counted: waiting, admitted (running or done), refused."""
    return int(pool["waiting"] + pool["admitted"] + sum(pool["refused"].values()))


def burst(
    server: Server, paths: list[str], health: Probe, senders: list[str] | None = None
) -> list[tuple[int, dict[str, str], bytes]]:
    """Start one request per path, each once the pool has counted the one before (a known
    arrival order, whatever the scheduling), all running or waiting at once; ``senders``,
    the client address each is forwarded for (the test server trusts 127.0.0.1 as its proxy)."""
    results: list[Any] = [None] * len(paths)
    base = seen(health.pool())

    def one(i: int) -> None:
        results[i] = get(server, paths[i], headers={"X-Forwarded-For": senders[i]} if senders else None)

    threads = []
    try:
        for i in range(len(paths)):
            thread = threading.Thread(target=one, args=(i,))
            thread.start()
            threads.append(thread)
            eventually_sync(lambda i=i: seen(health.pool()) >= base + i + 1, 10, f"request {i} counted")
    finally:
        for thread in threads:
            thread.join(60)
    return results


@pytest.mark.parametrize("server_kind", ["daphne", "uvicorn"])
def test_twenty_at_once_run_two_at_a_time_in_arrival_order_and_the_rest_get_503(database, server_kind):
    server = start(database, server_kind, wait_timeout_ms=20000)
    try:
        health = Probe(server)
        stats(server, reset=True)
        # The second runs longer: the slots free 0.75 s apart, never at once (two granted in
        # the same instant enter the view in their threads' order, not the queue's).
        paths = [f"/test/limited/?ms={2250 if i == 1 else 1500}&tag={i}" for i in range(20)]
        answers = burst(server, paths, health)
        statuses = [status for status, _, _ in answers]
        assert statuses == [200] * 10 + [503] * 10  # 2 running + 8 waiting; the later ones refused
        for _, headers, body in answers[10:]:
            assert int(headers["retry-after"]) >= 1
            assert json.loads(body)["reason"] == "queue_full"
        seen = stats(server)
        assert seen["max"] == 2  # never more than two inside the view
        assert seen["order"] == [str(i) for i in range(10)]  # FIFO
        eventually_sync(lambda: health.pool()["running"] == health.pool()["waiting"] == 0, 10, "the pool is idle again")
        pool = health.pool()
        assert pool["admitted"] == 10 and pool["refused"]["queue_full"] == 10
        assert pool["wait_ms"]["p99"] >= 4000  # the last served ones waited for four turns
        assert get(server, "/demo/heavy-unlimited/")[0] == 200  # matching no pool: untouched
    finally:
        server.stop()


def test_a_client_is_its_forwarded_address_and_an_ipv6_client_its_64(database):
    """Who a request's client is, on a live server behind a trusted proxy: the full queue
    sheds the busiest client's newest, so two addresses of one IPv6 /64 are one client
    (the second's request is that client's newest: refused), and another network is
    another client (it takes the busiest one's newest place and is served in turn).

    Found: only the pool was tested with the keys given; a constant client key, or every
    IPv6 address its own client, passed."""
    server = start(database, max_concurrent=1, max_waiting=3, wait_timeout_ms=20000)
    try:
        health = Probe(server)
        stats(server, reset=True)
        senders = ["2001:db8:1:2::a"] * 4 + ["2001:db8:1:2:ffff::b", "203.0.113.2"]
        tags = ["a0", "a1", "a2", "a3", "a-same-64", "b"]
        # a0 holds the slot long enough for every arrival to be counted (the others are short)
        paths = [f"/test/limited/?ms={3000 if tag == 'a0' else 300}&tag={tag}" for tag in tags]
        answers = burst(server, paths, health, senders)
        statuses = dict(zip(tags, (status for status, _, _ in answers), strict=True))
        assert statuses == {"a0": 200, "a1": 200, "a2": 200, "a3": 503, "a-same-64": 503, "b": 200}
        assert stats(server)["order"] == ["a0", "a1", "b", "a2"]  # in turn: b before a's older a2
        assert health.pool()["refused"]["queue_full"] == 2
    finally:
        server.stop()


def test_a_request_that_waits_too_long_gets_503_timeout(database):
    server = start(database, max_concurrent=1, wait_timeout_ms=300)
    try:
        health = Probe(server)
        first, second = burst(server, ["/test/limited/?ms=1500&tag=long", "/test/limited/?ms=10&tag=late"], health)
        assert first[0] == 200 and second[0] == 503
        assert json.loads(second[2])["reason"] == "timeout" and "retry-after" in second[1]
        assert health.pool()["refused"]["timeout"] == 1
    finally:
        server.stop()


@pytest.mark.parametrize("server_kind", ["daphne", "uvicorn"])
def test_a_client_that_disconnects_while_waiting_frees_its_place_at_once(database, server_kind):
    server = start(database, server_kind, max_concurrent=1)
    holder = threading.Thread(target=get, args=(server, "/test/limited/?ms=3000&tag=A"))
    try:
        health = Probe(server)
        stats(server, reset=True)
        holder.start()
        eventually_sync(lambda: health.pool()["running"] == 1, 10, "A runs")
        with socket.create_connection(("127.0.0.1", server.port)) as quitter:
            quitter.sendall(b"GET /test/limited/?ms=10&tag=B HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            eventually_sync(lambda: health.pool()["waiting"] == 1, 10, "B waits")
        # gone while waiting
        eventually_sync(lambda: health.pool()["waiting"] == 0, 5, "B's place freed")
        assert health.pool()["running"] == 1  # A still runs: B left the queue, not after A
        status, _, _ = get(server, "/test/limited/?ms=10&tag=C")
        holder.join(30)
        assert status == 200 and stats(server)["order"] == ["A", "C"]  # B never ran
        pool = health.pool()
        assert pool["refused"]["client_gone"] == 1 and pool["running"] == pool["waiting"] == 0
    finally:
        if holder.is_alive() or holder.ident is not None:
            holder.join(30)
        server.stop()


def test_a_raising_view_and_a_streaming_view_release_their_slots(database):
    server = start(database, max_concurrent=1)
    try:
        health = Probe(server)
        for _ in range(3):
            assert get(server, "/test/limited-raises/")[0] == 500
        assert health.pool()["running"] == 0
        # A stream holds its slot until the last chunk...
        streamed, after = burst(server, ["/test/limited-stream/?ms=600", "/test/limited/?ms=10&tag=after"], health)
        assert streamed[0] == 200 and len(streamed[2]) >= 5 * 1025 and after[0] == 200
        # ...or until the client goes away mid-stream.
        with socket.create_connection(("127.0.0.1", server.port)) as reader:
            reader.sendall(b"GET /test/limited-stream/?ms=30000 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert reader.recv(1024)
            assert health.pool()["running"] == 1
        eventually_sync(lambda: health.pool()["running"] == 0, 10, "the abandoned stream's slot released")
        assert get(server, "/test/limited/?ms=10&tag=next", timeout=10)[0] == 200
    finally:
        server.stop()


def test_the_sync_path_under_gunicorn_threads(database):
    server = start(database, "gunicorn", wait_timeout_ms=20000)
    try:
        stats(server, reset=True)
        health = Probe(server)
        # The second runs longer: the slots free 0.75 s apart, never at once (two granted in
        # the same instant enter the view in their threads' order, not the queue's).
        paths = [f"/test/limited-sync/?ms={2250 if i == 1 else 1500}&tag={i}" for i in range(12)]
        answers = burst(server, paths, health)
        assert [status for status, _, _ in answers] == [200] * 10 + [503] * 2
        inside = stats(server)
        assert inside["max"] == 2 and inside["order"] == [str(i) for i in range(10)]
        pool = health.pool()
        assert pool["running"] == pool["waiting"] == 0 and pool["refused"]["queue_full"] == 2
    finally:
        server.stop()


def test_health_and_metrics_are_never_limited(database):
    server = start(database, max_concurrent=1, max_waiting=0, paths=["/*"])  # everything else is limited
    holder = threading.Thread(target=get, args=(server, "/test/limited/?ms=4000&tag=A"))
    try:
        health = Probe(server)
        holder.start()
        eventually_sync(lambda: health.pool()["running"] == 1, 10, "A runs")
        assert get(server, "/accounts/login/")[0] == 503  # covered by "/*", and full
        assert health.pool()["running"] == 1  # the health endpoint itself got through
        status, text = health.metrics()  # and so does the metrics endpoint
        assert status == 200 and "realtime_http_pool_running{" in text
    finally:
        if holder.ident is not None:
            holder.join(30)
        server.stop()


def test_a_streaming_response_dropped_before_it_is_read_still_releases_its_slot():
    """Found in review: a response replaced or lost before iteration kept its slot forever."""
    import gc

    from django.http import StreamingHttpResponse

    from realtime_app.inbound.limiter import ConcurrencyPool, PoolSettings
    from realtime_app.middleware import _hand_over

    pool = ConcurrencyPool("t", PoolSettings(max_concurrent=1))
    slot = pool.acquire()
    response = StreamingHttpResponse(iter([b"never", b"read"]))
    _hand_over(pool, slot, response, time.monotonic())
    assert pool.running == 1
    del response  # an outer middleware replaced it, or the client left first
    gc.collect()
    assert pool.running == 0 and slot.released


async def test_a_waiter_whose_time_is_up_when_a_slot_frees_gets_503_not_a_late_slot():
    """Found: wait_ms p99 reached 10,379-10,628 ms against a 10,000 ms timeout: a slot
    passed to a waiter whose time was up (its loop too busy to run its timeout first) was
    taken, and the wait measured when the waiter ran again."""
    import asyncio

    from realtime_app.inbound.limiter import Busy, ConcurrencyPool, PoolSettings

    pool = ConcurrencyPool("t", PoolSettings(max_concurrent=1, max_waiting=5, wait_timeout_ms=100))
    held = await pool.aacquire()
    waiter = asyncio.get_running_loop().create_task(pool.aacquire())
    await eventually(lambda: pool.waiting == 1, 5, "the waiter queued")
    time.sleep(0.15)  # noqa: ASYNC251 -- the loop busy past the waiter's timeout, as on a loaded server
    held.release()  # the slot frees before the waiter's timeout could run
    with pytest.raises(Busy) as refused:
        await waiter
    assert refused.value.reason == "timeout"
    probe = pool.probe()
    assert probe["wait_ms"]["p99"] <= 100 and probe["refused"]["timeout"] == 1
    assert probe["running"] == 0 and probe["waiting"] == 0  # the slot went on, nothing leaked
    fresh = await pool.aacquire()
    assert fresh.waited_ms == 0.0
    fresh.release()


async def test_the_queue_serves_clients_in_turn_and_a_full_one_sheds_the_busiest_clients_newest():
    """Found: one client of the limiter got another's 11 of 13 requests answered 503 (one
    FIFO for everyone, and a full queue refused whoever came next). Each client now has
    its own FIFO, served in turn, and a lighter client takes the busiest one's newest place."""
    import asyncio

    from realtime_app.inbound.limiter import Busy, ConcurrencyPool, PoolSettings

    pool = ConcurrencyPool("fair", PoolSettings(max_concurrent=1, max_waiting=3, wait_timeout_ms=10_000))
    first = await pool.aacquire(("address", "a"))
    order: list[str] = []

    async def request(client: str, tag: str) -> str:
        try:
            slot = await pool.aacquire(("address", client))
        except Busy as busy:
            return f"{tag}:{busy.reason}"
        order.append(tag)
        await asyncio.sleep(0)
        slot.release()
        return tag

    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(request("a", f"a{i}")) for i in range(1, 4)]  # a fills the queue
    await eventually(lambda: pool.waiting == 3, 5, "a's three requests waiting")
    tasks.append(loop.create_task(request("b", "b1")))  # full: a's newest place goes to b
    await eventually(lambda: tasks[2].done(), 5, "a's newest answered queue_full")
    assert pool.waiting == 3
    first.release()
    results = await asyncio.gather(*tasks)
    assert results == ["a1", "a2", "a3:queue_full", "b1"]
    assert order == ["a1", "b1", "a2"]  # in turn, not a's whole backlog first
    assert pool.refused["queue_full"] == 1 and pool.running == 0 and pool.waiting == 0


@pytest.mark.parametrize("max_waiting", [1, 0])
async def test_a_client_holding_every_slot_and_a_waiting_place_still_leaves_another_its_turn(max_waiting):
    """Found: one client's flood held the pool; a second client's 18 requests were all 503
    — the queue compared waiters only, so a client running every slot with one request
    waiting refused everyone else, and with no waiting places at all nobody else could
    even queue. Now requests running count too, and a client below its share of the
    slots with nothing waiting gets a place (one, past max_waiting at most max_concurrent)."""
    import asyncio

    from realtime_app.inbound.limiter import Busy, ConcurrencyPool, PoolSettings

    pool = ConcurrencyPool("flood", PoolSettings(max_concurrent=2, max_waiting=max_waiting, wait_timeout_ms=10_000))
    a, b = ("address", "flooder"), ("address", "second")
    held = [await pool.aacquire(a), await pool.aacquire(a)]  # the flood runs in every slot
    loop = asyncio.get_running_loop()
    flood = [loop.create_task(pool.aacquire(a)) for _ in range(3)]  # and keeps asking
    if max_waiting == 0:  # refused at once: no place to wait, and the flood is over its share
        assert all(isinstance(r, Busy) for r in await asyncio.gather(*flood, return_exceptions=True))
    await eventually(lambda: pool.waiting == max_waiting, 5, "the flood's places taken")
    second = loop.create_task(pool.aacquire(b))
    await eventually(lambda: b in pool._queues, 5, "the second client queued, not refused")
    with pytest.raises(Busy):  # its second request waits for no second place: one below its share
        await pool.aacquire(b)
    held.pop().release()  # the next slot is the second client's
    slot = await asyncio.wait_for(second, 5)
    assert pool.running_by == {a: 1, b: 1}
    slot.release()
    for task in flood:
        if not task.done():
            task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    for s in held:
        s.release()
    await eventually(lambda: pool.running == 0 and pool.waiting == 0, 5, "every place given back")
    assert pool.running_by == {}
