"""The hub's own bounds, in-process: a custom backplane by dotted path, cadences and tickers
a client can start, the probe's size, publications that cannot be sent."""

from __future__ import annotations

import asyncio
import json

import pytest
from django.test import override_settings

from realtime_app import PublicationError, PublicationTooLarge
from realtime_app.conf import get_config
from tests.support.asgi_client import Client
from tests.testapp import backplanes
from tests.testapp.backplanes import CancelledAsCheckReturns, SlowToAnswer


def settings_with(**changes):
    return override_settings(REALTIME_APP={**get_config(), **changes})


async def test_a_custom_backplane_by_dotted_path_carries_the_cluster_work():
    from realtime_app.hub import get_hub

    backplanes.CALLS.clear()
    with settings_with(BACKPLANE="tests.testapp.backplanes.RecordingBackplane"):
        hub = await get_hub()
        try:
            assert type(hub.backplane).__name__ == "RecordingBackplane"
            async with Client() as c, Client() as publisher:
                assert "result" in await c.call("subscribe", {"channel": "demo:events"})
                seq = (await publisher.call("publish", {"channel": "demo:events", "data": 1}))["result"]["seq"]
                assert (await c.frames(1))[0]["seq"] == seq
                await c.call("unsubscribe", {"channel": "demo:events"})
        finally:
            await hub.aclose()
    assert ("join", ["demo:events"]) in backplanes.CALLS
    assert ("publish", "demo:events") in backplanes.CALLS
    assert ("leave", "demo:events") in backplanes.CALLS


async def test_past_the_cadence_cap_a_subscribe_gets_the_nearest_running_cadence(hub):
    with settings_with(MAX_CADENCES_PER_FAMILY=2):
        async with Client() as c:
            assert (await c.call("subscribe", {"channel": "demo:clock:200"}))["result"]["channel"] == "demo:clock:200"
            assert (await c.call("subscribe", {"channel": "demo:clock:2000"}))["result"]["channel"] == "demo:clock:2000"
            third = (await c.call("subscribe", {"channel": "demo:clock:500"}))["result"]
            assert third == {"channel": "demo:clock:200", "kind": "state", "interval_ms": 200}
            fourth = (await c.call("subscribe", {"channel": "demo:clock:1500"}))["result"]
            assert fourth["channel"] == "demo:clock:2000"
            assert hub.running_cadences("demo:clock") == [200, 2000]
            assert hub.probe()["refused"]["cadences"] == 2


async def test_past_the_ticker_cap_a_subscribe_is_refused_with_a_reason(hub):
    with settings_with(MAX_TICKERS=1):
        async with Client() as c:
            await c.call("subscribe", {"channel": "demo:clock:200"})
            error = (await c.call("subscribe", {"channel": "demo:clock:300"}))["error"]
            assert error["code"] == -32003
            assert error["data"]["reason"] == "too_many_tickers" and error["data"]["retry_after_ms"] > 0
            assert "result" in await c.call("subscribe", {"channel": "demo:events"})  # no ticker: not counted
            assert hub.probe()["refused"]["tickers"] == 1


async def test_the_probe_lists_the_busiest_channels_and_counts_the_rest(hub):
    with settings_with(MAX_CADENCES_PER_FAMILY=0, PROBE_TOP_CHANNELS=5):
        async with Client() as c:
            for ms in range(10000, 10030):
                assert "result" in await c.call("subscribe", {"channel": f"demo:clock:{ms}"})
            probe = hub.probe()
            assert len(probe["channels"]) == 5 and probe["channel_count"] == 30
            assert len(probe["tickers"]) == 5 and probe["ticker_count"] == 30


async def test_publications_that_cannot_be_sent_take_no_seq(hub):
    first = await hub.publish("demo:events", "ok")
    with pytest.raises(PublicationError):
        await hub.publish("demo:events", float("inf"))
    with settings_with(MAX_PUBLICATION_BYTES=10_000), pytest.raises(PublicationTooLarge) as info:
        await hub.publish("test:events", "x" * 10_000)
    assert info.value.limit == 10_000 and "MAX_PUBLICATION_BYTES" in str(info.value)
    with pytest.raises(PublicationTooLarge) as info:  # the demo's public channel has its own bound
        await hub.publish("demo:events", "x" * 5000)
    assert info.value.limit == 4096 and "max_bytes" in str(info.value)
    assert await hub.publish("demo:events", "\ud800") == first + 1  # a lone surrogate is escaped, not an error


async def test_the_largest_publication_accepted_makes_a_frame_within_the_bound(hub):
    """Found: frames of a channel with history were up to 29 bytes over
    MAX_PUBLICATION_BYTES (the epoch was not counted)."""
    limit = 2000
    async with Client() as c:
        await c.call("subscribe", {"channel": "test:short-history"})
        with settings_with(MAX_PUBLICATION_BYTES=limit):
            n = limit
            while True:  # the largest string payload that is accepted
                try:
                    await hub.publish("test:short-history", "x" * n)
                    break
                except PublicationTooLarge:
                    n -= 1
        frame = await c.comm.receive_from(3)
        assert json.loads(frame)["params"]["data"] == "x" * n
        assert len(frame.encode()) <= limit


async def test_a_publication_error_is_answered_as_invalid_params(hub):
    async with Client() as c:
        await c.send('{"jsonrpc":"2.0","method":"publish","params":{"channel":"demo:events","data":1e400},"id":1}')
        error = (await c.recv())["error"]
        assert error["code"] == -32602 and error["data"]["reason"] == "invalid_data"


@pytest.mark.parametrize("channel", ["test:broken", "test:failing-tick"])
async def test_a_failing_ticker_shows_in_the_probe(hub, channel):
    """Found: a ticker whose factory or tick fails sent nothing while subscribe succeeded,
    and nothing showed it."""
    from tests.support.waiting import eventually

    async with Client() as c:
        assert "result" in await c.call("subscribe", {"channel": channel})
        await eventually(lambda: hub.probe()["failing_tickers"] == [channel], 5, "the failing ticker in the probe")
        await c.call("unsubscribe", {"channel": channel})
        assert hub.probe()["failing_tickers"] == []


async def test_a_channel_lock_is_not_forgotten_while_a_converge_waits_for_it():
    """Found in review: a lock dropped while a waiter queued let two converges of one
    channel run at once, and an orphan ticker outlived its last subscriber."""
    import asyncio

    from realtime_app.declarations.registry import ChannelSpec
    from realtime_app.hub import Connection, get_hub

    live: set[int] = set()
    calls = [0]

    async def factory(spec, publish):
        await asyncio.sleep(0.02)
        calls[0] += 1
        n = calls[0]
        live.add(n)
        return lambda: live.discard(n)

    async def send(message):
        pass

    with settings_with(BACKPLANE="tests.testapp.backplanes.GatedBackplane", MAX_BACKPRESSURE=0):
        hub = await get_hub()
        try:
            spec = ChannelSpec("x", "state", "x", None, factory)
            c1, c2, c3 = Connection(send), Connection(send), Connection(send)
            for c in (c1, c2, c3):
                hub.add_connection(c)
            await hub.subscribe(c1, spec)
            backplanes.GatedBackplane.gate = asyncio.Event()
            leaving = asyncio.create_task(hub.unsubscribe(c1, "x"))  # waits in leave, holding the lock
            await asyncio.sleep(0)
            queued = [asyncio.create_task(hub.subscribe(c3, spec)), asyncio.create_task(hub.unsubscribe(c3, "x"))]
            await asyncio.sleep(0)

            async def late():
                await backplanes.GatedBackplane.gate.wait()
                await hub.subscribe(c2, spec)

            latecomer = asyncio.create_task(late())
            await asyncio.sleep(0)
            backplanes.GatedBackplane.gate.set()
            await asyncio.gather(leaving, *queued, latecomer)
            from tests.support.waiting import eventually

            def settled() -> bool:
                return not list(hub.reconciler.pending()) and not hub.convergence._lock_users

            await eventually(settled, 5, "nothing left to carry out")
            assert len(live) == 1 and hub.reconciler.running() == ["x"]  # one ticker for the one subscriber left
            await hub.unsubscribe(c2, "x")
            await eventually(settled, 5, "nothing left to carry out")
            assert live == set() and hub.probe()["tickers"] == []
        finally:
            backplanes.GatedBackplane.gate = None
            await hub.aclose()


async def test_a_ticker_stops_publishing_once_its_lease_cannot_be_renewed():
    """Found in review: a process cut off from Redis kept its ticker publishing while
    another process could take the lease over."""

    from realtime_app.hub import get_hub

    backplanes.ClusteredMemoryBackplane.renew_fails = False
    with settings_with(BACKPLANE="tests.testapp.backplanes.ClusteredMemoryBackplane", LEASE_TTL_MS=600):
        hub = await get_hub()
        try:
            async with Client() as c:
                await c.call("subscribe", {"channel": "demo:clock:100"})
                await c.frames(3)
                from tests.support.waiting import eventually

                backplanes.ClusteredMemoryBackplane.renew_fails = True
                await eventually(lambda: hub.tickers.stale_ticks > 0, 5, "ticks held back")  # past the lease TTL
                published, held = hub.published, hub.tickers.stale_ticks
                await eventually(lambda: hub.tickers.stale_ticks >= held + 3, 5, "three more ticks held back")
                assert hub.published == published  # nothing goes out without a fresh lease
                backplanes.ClusteredMemoryBackplane.renew_fails = False
                await eventually(lambda: hub.published > published, 5, "publishing again once renewed")
        finally:
            backplanes.ClusteredMemoryBackplane.renew_fails = False
            await hub.aclose()


async def test_a_ticker_cut_off_from_a_paused_redis_holds_its_ticks_back_then_goes_on(private_redis):
    """The same on a real Redis that stops answering (paused: calls hang until their
    timeout, they do not fail at once): once the lease is older than its TTL the ticks
    are held back, and they go out again when Redis answers."""
    from realtime_app.hub import get_hub
    from tests.support.waiting import eventually

    with settings_with(
        BACKPLANE="redis", REDIS_URL=private_redis.url, KEY_PREFIX="stale", LEASE_TTL_MS=600, REDIS_TIMEOUT_MS=300
    ):
        hub = await get_hub()
        try:
            async with Client() as c:
                await c.call("subscribe", {"channel": "demo:clock:100"})
                await c.frames(3)
                private_redis.pause()
                await eventually(lambda: hub.tickers.stale_ticks > 0, 10, "ticks held back")
                published, held = hub.published, hub.tickers.stale_ticks
                await eventually(lambda: hub.tickers.stale_ticks >= held + 3, 10, "three more ticks held back")
                assert hub.published == published
                private_redis.resume()
                await eventually(lambda: hub.published > published, 10, "publishing again once Redis answers")
                await c.frames(1)  # and the subscriber gets them
        finally:
            private_redis.resume()
            await hub.aclose()


async def test_a_cancel_landing_as_the_beat_checks_the_backplane_stops_the_beat():
    """Found: one run in two of an admission test hung 120 s in the hub's teardown; on
    Python 3.11 ``asyncio.wait_for`` swallows a cancel that lands as the awaited call
    returns, and the beat went on forever after ``aclose()`` cancelled it."""
    from realtime_app.hub import get_hub

    with settings_with(BACKPLANE="tests.testapp.backplanes.CancelledAsCheckReturns", LEASE_TTL_MS=300):
        hub = await get_hub()
        maintain = next(t for t in hub._tasks if t.get_name() == "realtime-maintain")
        CancelledAsCheckReturns.armed = True
        try:
            from tests.support.waiting import eventually

            await eventually(maintain.done, 5, "the beat stopped")
            assert maintain.cancelled()
        finally:
            CancelledAsCheckReturns.armed = False
            await asyncio.wait_for(hub.aclose(), 10)


async def test_one_slow_answer_to_the_beat_is_not_an_outage_two_in_a_row_are():
    """Found: under CPU load with Redis healthy, the beat's 1 s timeout logged false
    `RedisBackplane unreachable` lines."""
    from realtime_app.hub import get_hub

    with settings_with(BACKPLANE="tests.testapp.backplanes.SlowToAnswer", LEASE_TTL_MS=300):
        hub = await get_hub()
        try:
            maintain = next(t for t in hub._tasks if t.get_name() == "realtime-maintain")
            maintain.cancel()  # the beats are this test's own
            backplane = hub.backplane
            assert backplane is not None
            SlowToAnswer.delay = 0.7  # past the beat's timeout (0.5 s at this lease)
            await hub.convergence.beat(backplane)
            assert not backplane.outage.down  # one slow beat: re-asserted, not logged down
            SlowToAnswer.delay = 0.0
            await hub.convergence.beat(backplane)
            SlowToAnswer.delay = 0.7
            await hub.convergence.beat(backplane)
            assert not backplane.outage.down  # a good beat in between starts the count again
            await hub.convergence.beat(backplane)
            assert backplane.outage.down  # two in a row: down
        finally:
            SlowToAnswer.delay = 0.0
            await asyncio.wait_for(hub.aclose(), 10)


async def test_a_paused_redis_answers_a_resume_and_a_publish_with_backplane_unavailable(private_redis):
    """-32003 backplane_unavailable against a real Redis that stops answering (it was only
    tried against hand-made failing histories): the calls answer within the Redis timeout,
    and work again once it answers."""
    from realtime_app.hub import get_hub
    from tests.support.waiting import eventually

    with settings_with(BACKPLANE="redis", REDIS_URL=private_redis.url, KEY_PREFIX="paused", REDIS_TIMEOUT_MS=300):
        hub = await get_hub()
        try:
            async with Client() as c:
                first = (await c.call("subscribe", {"channel": "demo:events"}))["result"]
                private_redis.pause()
                since = {"seq": first["seq"], "epoch": first["epoch"]}
                async with Client() as other:
                    resumed = await asyncio.wait_for(
                        other.call("subscribe", {"channel": "demo:events", "since": since}), 10
                    )
                    assert resumed["error"]["code"] == -32003, resumed
                    assert resumed["error"]["data"]["reason"] == "backplane_unavailable"
                    assert resumed["error"]["data"]["retry_after_ms"] > 0
                    published = await asyncio.wait_for(
                        other.call("publish", {"channel": "demo:events", "data": {"n": 1}}), 10
                    )
                    assert published["error"]["data"]["reason"] == "backplane_unavailable", published
                private_redis.resume()

                async def served() -> bool:
                    async with Client() as again:
                        answer = await again.call("subscribe", {"channel": "demo:events", "since": since})
                        return "result" in answer

                await eventually(served, 15, "a resume once Redis answers")
        finally:
            private_redis.resume()
            await hub.aclose()


def test_the_process_ceiling_keeps_a_reserve_for_signed_in_users():
    """Found: caps were per address only — 400 addresses opened 19,976 sockets and a user's
    login got a reset. Many anonymous identities together now stop at the ceiling less the
    signed-in reserve ("server full"), and a signed-in user still gets in."""
    from realtime_app.hub.gate import Gate

    with settings_with(MAX_CONNECTIONS=10, SIGNED_IN_RESERVE=0.2, MAX_CONNECTIONS_PER_ADDRESS=50):
        gate = Gate()
        admitted = [gate.enter(("address", f"10.0.0.{i}")) for i in range(12)]
        assert admitted == [None] * 8 + ["server full"] * 4  # 10 less the reserve of 2
        assert [gate.enter(("user", str(i))) for i in range(3)] == [None, None, "server full"]
        gate.leave(("address", "10.0.0.0"))
        assert gate.enter(("address", "10.0.0.99")) is None  # a place given back is taken again
        assert gate.refused["server_full"] == 5
        assert gate.enter(("address", "10.0.0.1")) == "server full"  # the process before its own cap


def test_anonymous_handshakes_share_one_process_bucket_signed_in_ones_do_not():
    from realtime_app.hub.gate import Gate

    with settings_with(MAX_ANONYMOUS_HANDSHAKES_PER_S=5, HANDSHAKES_PER_S=0):
        gate = Gate()
        burst = [gate.handshake(("address", f"10.1.0.{i}")) for i in range(12)]
        assert burst.count(True) == 10 and burst[-1] is False  # twice the rate, from any number of addresses
        assert all(gate.handshake(("user", str(i))) for i in range(12))  # the reserve: not this bucket
        assert gate.refused["process_handshakes"] == 2


@pytest.mark.parametrize(
    ("address", "v4", "v6", "expected"),
    [
        ("198.51.100.7", 32, 64, "198.51.100.7"),
        ("2001:db8:1:2:aaaa::1", 32, 64, "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::9", 32, 64, "2001:db8:1:2::/64"),  # the same host's other address
        ("198.51.100.7", 24, 64, "198.51.100.0/24"),
        ("2001:db8::1", 32, 128, "2001:db8::1"),
        ("unknown", 32, 64, "unknown"),
        ("::ffff:198.51.100.7", 32, 64, "198.51.100.7"),  # review: a dual-stack bind's IPv4 clients were one /64
        ("::ffff:203.0.113.9", 32, 64, "203.0.113.9"),
        ("198.51.100.7", 40, 64, "198.51.100.7"),  # a prefix longer than the address: the address
        ("2001:db8::1", 32, 200, "2001:db8::1"),
        ("2001:db8:1:2:aaaa::1", 32, 63, "2001:db8:1:2::/63"),
        ("198.51.100.7", 31, 64, "198.51.100.6/31"),
    ],
)
def test_anonymous_clients_are_counted_by_network(address, v4, v6, expected):
    from realtime_app.endpoint.addresses import client_network

    assert client_network(address, v4, v6) == expected


def test_the_networks_by_default_are_an_ipv4_address_and_an_ipv6_64():
    from realtime_app.endpoint.addresses import client_network

    assert client_network("2001:db8:1:2:aaaa::1") == "2001:db8:1:2::/64"
    assert client_network("198.51.100.7") == "198.51.100.7"


def test_one_address_over_its_own_handshake_rate_takes_nothing_from_the_others():
    """Review: the process bucket was drawn before the address's own, so the handshakes one
    address was refused anyway emptied it for every other anonymous client."""
    from realtime_app.hub.gate import Gate

    with settings_with(MAX_ANONYMOUS_HANDSHAKES_PER_S=5, HANDSHAKES_PER_S=1.0, HANDSHAKE_BURST=1):
        gate = Gate()
        flood = [gate.handshake(("address", "203.0.113.9")) for _ in range(20)]
        assert flood.count(True) == 1
        assert gate.handshake(("address", "198.51.100.1"))  # the others' bucket is untouched


def test_a_process_handshake_rate_under_one_still_admits_one():
    from realtime_app.hub.gate import Gate

    with settings_with(MAX_ANONYMOUS_HANDSHAKES_PER_S=0.2, HANDSHAKES_PER_S=0):
        assert Gate().handshake(("address", "198.51.100.1"))


async def test_a_hub_runs_what_the_wiring_lists_however_it_was_started():
    """No registration by import: a hub made here, outside Django's ready() and any
    request, runs the endpoint's loops and answers its control messages."""
    from realtime_app.endpoint.wiring import parts
    from realtime_app.hub.core import Hub

    hub = Hub()
    await hub.start()
    try:
        names = {task.get_name() for task in asyncio.all_tasks()}
        assert {"realtime-revalidate", "realtime-drain-held", "realtime-publisher", "realtime-maintain"} <= names
        assert set(hub.parts.handlers) == {"logout", "close_connection"} == set(parts().handlers)
    finally:
        await hub.aclose()


async def test_a_close_of_the_hub_cancelled_at_any_step_leaves_no_loop_and_no_connection(private_redis):
    """Found by a review: ``Hub.aclose`` cut by a cancel (a shutdown's bound, the repeated
    cancel of a task that stops it) skipped the rest of the close — the loops went on and
    the backplane was never stopped, its Redis connections open, owned by nothing. Each
    step of a close cancelled in turn: no task of the hub's and no connection left."""
    from realtime_app.hub.core import Hub
    from tests.support.cancelling import cancelled_after
    from tests.support.waiting import eventually

    def open_connections() -> int:
        client = private_redis.client()
        try:
            return len(client.client_list()) - 1
        finally:
            client.close()

    with settings_with(BACKPLANE="redis", REDIS_URL=private_redis.url, KEY_PREFIX="closing"):
        steps = 0
        while True:
            before = asyncio.all_tasks()
            hub = Hub()  # (a closed hub stays closed: one each time)
            await hub.start()
            assert await asyncio.to_thread(open_connections) >= 1
            finished = await cancelled_after(steps, hub.aclose())
            left = [t.get_name() for t in asyncio.all_tasks() - before if t.get_name().startswith("realtime-")]
            assert left == [], f"the hub's tasks left by a close cancelled after {steps} steps"

            async def closed() -> bool:
                return await asyncio.to_thread(open_connections) == 0

            await eventually(closed, 10, f"every connection closed by a close cancelled after {steps} steps")
            if finished:
                break
            steps += 1
        assert steps >= 3
