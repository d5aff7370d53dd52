"""Each identity's share of a process's tickers and live instances: one anonymous address
with many idle sockets cannot take every ticker or room, and signed-in users keep a
reserve of them (the attack: ten sockets of one address held all 1,000 tickers)."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from realtime_app.conf import get_config
from realtime_app.declarations.registry import registry
from realtime_app.hub.shares import ShareBook, share_keys
from tests.support.asgi_client import Client


def settings_with(**changes):
    return override_settings(REALTIME_APP={**get_config(), **changes})


def refusal(answer):
    error = answer["error"]
    return error["code"], error["data"]["reason"], error["data"]["bound"], error["data"]["limit"]


async def test_an_address_holds_its_share_of_tickers_however_many_sockets_it_opens(hub):
    with settings_with(MAX_TICKERS_PER_IDENTITY=3, MAX_TICKERS=100):
        async with Client(address="203.0.113.9") as a, Client(address="203.0.113.9") as b:
            for ms in (1000, 1100):
                assert "result" in await a.call("subscribe", {"channel": f"demo:clock:{ms}"})
            assert "result" in await b.call("subscribe", {"channel": "demo:clock:1200"})
            for client, ms in ((a, 1300), (b, 1400)):  # its second socket has no share of its own
                answer = await client.call("subscribe", {"channel": f"demo:clock:{ms}"})
                assert refusal(answer) == (-32003, "too_many_tickers", "identity", 3)
                assert answer["error"]["data"]["retry_after_ms"] > 0
            # one it holds (on another socket too) takes no new place; a channel without a ticker is not counted
            assert "result" in await b.call("subscribe", {"channel": "demo:clock:1000"})
            assert "result" in await a.call("subscribe", {"channel": "demo:events"})
            async with Client(address="203.0.113.10") as other:  # another address: its own share
                assert "result" in await other.call("subscribe", {"channel": "demo:clock:1300"})
            await a.call("unsubscribe", {"channel": "demo:clock:1100"})  # a place freed
            assert "result" in await a.call("subscribe", {"channel": "demo:clock:1400"})
            assert hub.probe()["refused"]["ticker_shares"] == 2
        # its sockets closed: every place given back
        assert hub.shares.refs == {} and hub.shares.entries == {}


async def test_an_address_holds_its_share_of_instances_across_templates_and_cadences(hub):
    with settings_with(MAX_INSTANCES_PER_IDENTITY=2):
        async with Client(address="203.0.113.20") as a:
            for name in ("test:bids:1", "test:lot:1:250", "test:lot:1:500"):  # lot 1: one instance, two cadences
                assert "result" in await a.call("subscribe", {"channel": name}), name
            answer = await a.call("subscribe", {"channel": "test:room:kitchen"})
            assert refusal(answer) == (-32003, "too_many_instances", "identity", 2)
            assert "result" in await a.call("subscribe", {"channel": "test:lot:1"})  # lot 1 again
            assert hub.shares.count(("address", "203.0.113.20"), "instance") == 2
            assert hub.probe()["refused"]["instance_shares"] == 1


@pytest.mark.django_db(transaction=True)
async def test_anonymous_subscribers_leave_the_signed_in_reserve_of_tickers(hub, django_user_model):
    user = await sync_to_async(django_user_model.objects.create_user)("rita", password="p")
    with settings_with(MAX_TICKERS=10, SIGNED_IN_RESERVE=0.2, MAX_TICKERS_PER_IDENTITY=0):
        async with Client(address="198.51.100.1") as x, Client(address="198.51.100.2") as y:
            for i in range(8):  # two addresses fill the anonymous part: 8 of 10
                client = x if i % 2 else y
                assert "result" in await client.call("subscribe", {"channel": f"demo:clock:{2000 + i}"})
            answer = await x.call("subscribe", {"channel": "demo:clock:2100"})
            assert refusal(answer) == (-32003, "too_many_tickers", "anonymous", 8)
            assert "result" in await x.call("subscribe", {"channel": "demo:clock:2000"})  # running: it fits
            async with Client(user) as signed_in:
                for ms in (2200, 2300):
                    assert "result" in await signed_in.call("subscribe", {"channel": f"demo:clock:{ms}"})
                answer = await signed_in.call("subscribe", {"channel": "demo:clock:2400"})
                assert refusal(answer) == (-32003, "too_many_tickers", "process", 10)


@pytest.mark.django_db(transaction=True)
async def test_anonymous_subscribers_leave_the_signed_in_reserve_of_instances(hub, django_user_model):
    user = await sync_to_async(django_user_model.objects.create_user)("sam", password="p")
    with settings_with(MAX_INSTANCES_PER_TEMPLATE=5, SIGNED_IN_RESERVE=0.4, MAX_INSTANCES_PER_IDENTITY=0):
        async with Client(address="198.51.100.3") as x:
            for n in (1, 2, 3):
                assert "result" in await x.call("subscribe", {"channel": f"test:bids:{n}"})
            answer = await x.call("subscribe", {"channel": "test:bids:4"})
            assert refusal(answer) == (-32003, "too_many_instances", "anonymous", 3)
            async with Client(user) as signed_in:
                for n in (4, 5):
                    assert "result" in await signed_in.call("subscribe", {"channel": f"test:bids:{n}"})
                answer = await signed_in.call("subscribe", {"channel": "test:bids:6"})
                assert refusal(answer) == (-32003, "too_many_instances", "template", 5)


@pytest.mark.django_db(transaction=True)
async def test_ten_sockets_of_one_address_leave_a_signed_in_user_its_lots_and_clocks(hub, django_user_model):
    """The attack as filed, scaled down: one address, ten idle sockets, subscribing lot
    cadences until refused; a signed-in user's lot and a new clock still start."""
    user = await sync_to_async(django_user_model.objects.create_user)("una", password="p")
    with settings_with(MAX_TICKERS=60, MAX_CADENCES_PER_FAMILY=0):
        share = get_config()["MAX_TICKERS_PER_IDENTITY"]
        sockets = [Client(address="192.0.2.200") for _ in range(10)]
        for s in sockets:
            await s.__aenter__()
        try:
            taken = 0
            for lot in range(1, 21):
                for ms in (300, 400, 500):
                    answer = await sockets[(lot * 3 + ms) % 10].call("subscribe", {"channel": f"test:lot:{lot}:{ms}"})
                    taken += "result" in answer
            assert taken == share
            async with Client(user) as victim:
                assert "result" in await victim.call("subscribe", {"channel": "test:lot:7"})
                assert "result" in await victim.call("subscribe", {"channel": "demo:clock:700"})
        finally:
            for s in sockets:
                await s.__aexit__()


class ShareBookMachine(RuleBasedStateMachine):
    """Any order of subscriptions taken and given back by connections of a few
    identities: each identity's counts are the distinct tickers and instances its live
    subscriptions hold, and nothing is left once every subscription ended."""

    CHANNELS = ("demo:clock:1000", "demo:clock:1500", "test:lot:1:250", "test:lot:1:500", "test:bids:1", "demo:events")

    def __init__(self) -> None:
        super().__init__()
        self.book = ShareBook()
        self.live: dict[tuple[int, str], tuple[str, str]] = {}

    @rule(conn=st.integers(0, 3), channel=st.sampled_from(CHANNELS), who=st.sampled_from(["a", "b"]))
    def take(self, conn: int, channel: str, who: str) -> None:
        identity, channel = ("address", who), registry.resolve(channel).name
        if (conn, channel) in self.live:
            identity = self.live[(conn, channel)]  # a connection's subscription is counted once
        self.book.take(conn, identity, registry.resolve(channel))
        self.live[(conn, channel)] = identity

    @rule(conn=st.integers(0, 3), channel=st.sampled_from(CHANNELS))
    def give(self, conn: int, channel: str) -> None:
        channel = registry.resolve(channel).name
        self.book.give(conn, channel)
        self.live.pop((conn, channel), None)

    @invariant()
    def counts_are_the_distinct_keys_held(self) -> None:
        for who in ("a", "b"):
            identity = ("address", who)
            keys = {
                key
                for entry, owner in self.live.items()
                if owner == identity
                for key in share_keys(registry.resolve(entry[1]))
            }
            for kind in ("ticker", "instance"):
                assert self.book.count(identity, kind) == sum(1 for key in keys if key[0] == kind)
        if not self.live:
            assert self.book.refs == {} and self.book.held == {} and self.book.entries == {}


def test_the_share_book_counts_what_each_identity_holds(settings):
    settings.REALTIME_APP = {**get_config(), "MAX_TICKERS_PER_IDENTITY": 0, "MAX_INSTANCES_PER_IDENTITY": 0}
    ShareBookMachine.TestCase.settings = hypothesis_settings(max_examples=100, stateful_step_count=30, deadline=None)
    ShareBookMachine.TestCase().runTest()


async def test_the_backplane_state_an_identitys_subscribes_keep_live_is_bounded_in_bytes(redis_url):
    """Found: every fresh instance a subscribe named left keys on Redis that the instance
    bound never saw; one address churning rooms (subscribe, unsubscribe, next) held about
    765 MB. What an identity's subscribes make live is now counted in bytes until it
    expires (the channel's history TTL), bounded by MAX_BACKPLANE_BYTES_PER_IDENTITY."""
    import os
    import secrets

    import redis

    from realtime_app.hub import get_hub
    from realtime_app.hub.shares import lineage_bytes

    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-shares-{secrets.token_hex(3)}"
    bound = 3 * lineage_bytes("test:room:churn-0")
    config = {
        **get_config(),
        "BACKPLANE": "redis",
        "REDIS_URL": redis_url,
        "KEY_PREFIX": prefix,
        "MAX_BACKPLANE_BYTES_PER_IDENTITY": bound,
    }
    try:
        with override_settings(REALTIME_APP=config):
            hub = await get_hub()
            now = [1000.0]
            hub.shares.clock = lambda: now[0]
            try:
                async with Client(address="203.0.113.66") as churner, Client(address="203.0.113.67") as other:
                    for n in range(3):  # a fresh room each time, left at once: live, then gone
                        assert "result" in await churner.call("subscribe", {"channel": f"test:room:churn-{n}"})
                        await churner.call("unsubscribe", {"channel": f"test:room:churn-{n}"})
                    answer = await churner.call("subscribe", {"channel": "test:room:churn-3"})
                    assert refusal(answer) == (-32003, "too_many_instances", "backplane_bytes", bound)
                    assert 0 < answer["error"]["data"]["retry_after_ms"] <= 60_000  # the room's history TTL
                    assert "result" in await other.call("subscribe", {"channel": "test:room:churn-4"})
                    assert hub.probe()["backplane_bytes"] == 4 * lineage_bytes("test:room:churn-0")
                    assert hub.probe()["refused"]["backplane_bytes"] == 1
                    now[0] += 60.001  # the rooms' history TTL: their keys expired on Redis too
                    assert "result" in await churner.call("subscribe", {"channel": "test:room:churn-3"})
            finally:
                await hub.aclose()
    finally:
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()


async def test_an_instance_its_exists_hook_refuses_leaves_no_key_by_subscribe_or_publish_api(redis_url):
    import json
    import os
    import secrets

    import redis
    from django.test import RequestFactory

    from realtime_app.hub import get_hub
    from realtime_app.views import publish_api
    from realtime_app.wire.names import group_name

    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-exists-{secrets.token_hex(3)}"
    config = {**get_config(), "BACKPLANE": "redis", "REDIS_URL": redis_url, "KEY_PREFIX": prefix}
    client = redis.Redis.from_url(redis_url)
    try:
        with override_settings(REALTIME_APP={**config, "PUBLISH_API_KEYS": ["k-exists"]}):
            hub = await get_hub()
            try:
                async with Client() as c:
                    answer = await c.call("subscribe", {"channel": "test:bids:999"})  # lot 999 does not exist
                    assert answer["error"]["data"]["reason"] == "unknown_channel"
                    assert "result" in await c.call("subscribe", {"channel": "test:bids:7"})  # one that does
                request = RequestFactory().post(
                    "/realtime/api/publish",
                    data=json.dumps({"channel": "test:bids:999", "data": 1}),
                    content_type="application/json",
                    HTTP_AUTHORIZATION="Bearer k-exists",
                )
                assert (await publish_api(request)).status_code == 404
            finally:
                await hub.aclose()
        names = [key.decode() for key in client.scan_iter(match=f"{prefix}*")]
        assert not [name for name in names if name.endswith(group_name("test:bids:999"))], names
        assert [name for name in names if name.endswith(group_name("test:bids:7"))], names  # it sees keys at all
    finally:
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()


def test_backplane_bytes_expire_each_at_its_own_time_and_quiet_identities_are_forgotten():
    """Entries of different TTLs (each channel's own history TTL): one long-lived entry
    does not keep the short ones behind it counted."""
    now = [100.0]
    book = ShareBook(clock=lambda: now[0])
    who, other = ("address", "a"), ("address", "b")
    book.stored_by(who, 1000, 86_400_000)  # a day
    for _ in range(300):
        book.stored_by(who, 1000, 60_000)  # a minute
    book.stored_by(other, 500, 60_000)
    assert book.bytes_of(who) == 301_000
    now[0] += 120
    assert book.bytes_of(who) == 1000 and book.total_bytes() == 1000
    assert other not in book.stored_bytes  # a quiet identity is forgotten
