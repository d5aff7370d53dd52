"""The Redis backplane's own wire: a publication is numbered, kept and published in one
call on the channel's Redis channel, and reaches each subscribed process in ``seq`` order;
nothing of a channel layer's stored format is read or written. Real Redis."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import AsyncIterator

import pytest
import redis
from django.test import override_settings

from realtime_app.cluster.base import Delivery
from realtime_app.cluster.hosts import layer_hosts
from realtime_app.cluster.redis import RedisBackplane
from realtime_app.cluster.shards import ShardedBackplane
from realtime_app.wire.history import HistoryPolicy
from realtime_app.wire.protocol import notification_text
from tests.support.private_redis import PrivateRedis
from tests.support.waiting import eventually

DATA = '{"n":1,"s":"caf\\u00e9"}'


@pytest.fixture
async def prefix(redis_url: str) -> AsyncIterator[str]:
    """A key prefix of this test's own; its keys deleted after."""
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-wire-{secrets.token_hex(3)}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    client.close()


class Process:
    """A backplane receiving into a list, as one process of the cluster would."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.backplane = RedisBackplane(
            instance_id=f"wire-{secrets.token_hex(2)}", config={"KEY_PREFIX": prefix, "REDIS_URL": redis_url}
        )
        self.got: list[Delivery] = []

    async def __aenter__(self) -> Process:
        async def deliver(delivery: Delivery) -> None:
            self.got.append(delivery)

        await self.backplane.start(deliver)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.backplane.stop()

    async def until(self, n: int, timeout: float = 10) -> list[Delivery]:
        await eventually(lambda: len(self.got) >= n, timeout, f"{n} deliveries")
        return self.got


def stamp(text: str) -> int:
    return int(json.loads(text)["params"]["ts"])


async def test_publications_reach_every_subscribed_process_in_seq_order(redis_url, prefix) -> None:
    async with Process(redis_url, prefix) as a, Process(redis_url, prefix) as b, Process(redis_url, prefix) as pub:
        await a.backplane.join(["wire:a"])
        await b.backplane.join(["wire:a"])
        seqs = await asyncio.gather(*(pub.backplane.publish("wire:a", DATA) for _ in range(200)))
        assert sorted(seqs) == list(range(1, 201))
        for process in (a, b):
            got = await process.until(200)
            assert [d.seq for d in got] == list(range(1, 201))  # in seq order, each once
            first = got[0]
            assert (first.kind, first.channel, first.epoch) == ("frame", "wire:a", "")
            assert first.text == notification_text("wire:a", DATA, 1, stamp(first.text))
            assert abs(stamp(first.text) - time.time() * 1000) < 60_000
        assert pub.got == []  # not subscribed: nothing


async def test_a_kept_publication_carries_its_epoch(redis_url, prefix) -> None:
    async with Process(redis_url, prefix) as a:
        await a.backplane.join(["wire:kept"])
        seq = await a.backplane.publish("wire:kept", DATA, history=HistoryPolicy(10, 60_000))
        [delivery] = await a.until(1)
        assert len(delivery.epoch) == 19 and delivery.seq == seq
        assert delivery.text == notification_text("wire:kept", DATA, seq, stamp(delivery.text), delivery.epoch)
        read = await a.backplane.history("wire:kept", HistoryPolicy(10, 60_000))
        assert (read.epoch, read.top) == (delivery.epoch, seq)


async def test_a_released_lease_is_told_to_the_others_not_to_itself(redis_url, prefix) -> None:
    async with Process(redis_url, prefix) as holder, Process(redis_url, prefix) as other:
        await holder.backplane.join(["wire:tick"])
        await other.backplane.join(["wire:tick"])
        assert await holder.backplane.acquire("wire:tick")
        await holder.backplane.release("wire:tick")
        [told] = await other.until(1)
        assert (told.kind, told.channel) == ("released", "wire:tick")
        await holder.backplane.publish("wire:tick", DATA)  # a frame after it, to both
        assert [d.kind for d in await holder.until(1)] == ["frame"]  # its own release was not delivered


async def test_a_process_that_left_gets_nothing_more(redis_url, prefix) -> None:
    async with Process(redis_url, prefix) as a:
        await a.backplane.join(["wire:left", "wire:stay"])
        await a.backplane.publish("wire:left", DATA)
        await a.until(1)
        await a.backplane.leave("wire:left")
        await a.backplane.publish("wire:left", DATA)
        await a.backplane.publish("wire:stay", DATA)
        got = await a.until(2)
        assert [d.channel for d in got] == ["wire:left", "wire:stay"]  # the stay frame came after: none between


async def test_a_pubsub_connection_that_redis_drops_subscribes_again(prefix) -> None:
    """Redis cuts a pub/sub client that reads too slowly (client-output-buffer-limit), or
    restarts: the connection comes back with every subscription, and frames flow again."""
    server = PrivateRedis().start()  # its clients are this test's alone: killing one is fine
    try:
        async with Process(server.url, prefix) as a, Process(server.url, prefix) as pub:
            await a.backplane.join(["wire:drop"])
            await pub.backplane.publish("wire:drop", DATA)
            await a.until(1)
            client = server.client()
            subscribers = [info for info in client.client_list(_type="pubsub") if int(info["sub"]) == 2]
            assert len(subscribers) == 1  # a's connection: its own channel and wire:drop
            assert client.client_kill_filter(_id=subscribers[0]["id"]) == 1

            async def published_and_received() -> bool:  # again until the reconnected connection takes one
                await pub.backplane.publish("wire:drop", DATA)
                return len(a.got) >= 2

            await eventually(published_and_received, 20, "a frame after the drop")
            assert a.got[-1].channel == "wire:drop"
    finally:
        server.close()


@pytest.mark.parametrize(
    "backend", ["channels_redis.core.RedisChannelLayer", "channels_redis.pubsub.RedisPubSubChannelLayer"]
)
def test_the_redis_is_the_layers_first_host_on_both_layers(backend) -> None:
    layers = {"default": {"BACKEND": backend, "CONFIG": {"hosts": ["redis://127.0.0.1:6399/3"]}}}
    with override_settings(CHANNEL_LAYERS=layers):
        assert layer_hosts()[0]["address"] == "redis://127.0.0.1:6399/3"
        backplane = RedisBackplane(config={})
        kwargs = backplane.redis.connection_pool.connection_kwargs
        assert (kwargs["port"], kwargs["db"]) == (6399, 3)


async def test_a_task_that_swallows_a_cancel_is_stopped_all_the_same() -> None:
    """What Python 3.11's ``wait_for`` inside redis-py does to a receive loop: the first
    cancel is lost and the loop blocks again; the stop must not hang on it."""
    from realtime_app.cancellation import cancel_and_wait

    lost = []

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            lost.append(True)  # swallowed: the loop goes on
        await asyncio.sleep(3600)

    task = asyncio.get_running_loop().create_task(stubborn())
    await asyncio.sleep(0)
    async with asyncio.timeout(30):
        await cancel_and_wait(task)
    assert task.cancelled() and lost == [True]


async def test_the_list_of_live_processes_expires_with_the_last_probe(redis_url, prefix) -> None:
    """Found: a cluster killed at once (SIGKILL) left ``<prefix>:instances`` in Redis for good."""
    client = redis.Redis.from_url(redis_url, single_connection_client=True)
    async with Process(redis_url, prefix) as a:
        try:
            await a.backplane.put_probe({"instance": a.backplane.instance_id}, 5000)
            assert 0 < client.pttl(f"{prefix}:instances") <= 5000
        finally:
            client.close()


async def test_the_cluster_view_reads_the_others_probes_and_decodes_only_what_changed(redis_url, prefix) -> None:
    """A scrape reads every other process's probe; each is republished every few seconds
    and read far more often. Found: the process's own probe was read and decoded on every
    scrape only to be dropped for its fresh one, and every other probe decoded again."""
    async with Process(redis_url, prefix) as a, Process(redis_url, prefix) as b:
        await a.backplane.put_probe({"instance": a.backplane.instance_id, "n": 1}, 5000)
        await b.backplane.put_probe({"instance": b.backplane.instance_id, "n": 1}, 5000)
        first = await a.backplane.cluster_probes()
        assert first == [{"instance": b.backplane.instance_id, "n": 1}]  # not its own
        again = await a.backplane.cluster_probes()
        assert again[0] is first[0]  # the same bytes: not decoded again
        await b.backplane.put_probe({"instance": b.backplane.instance_id, "n": 2}, 5000)
        assert (await a.backplane.cluster_probes()) == [{"instance": b.backplane.instance_id, "n": 2}]
        await b.backplane.drop_probe()
        assert await a.backplane.cluster_probes() == []


async def test_stopping_ends_a_receiver_that_swallowed_the_cancel_and_closes_the_pool(redis_url, prefix) -> None:
    """Found: a stop hung when redis-py's ``wait_for`` swallowed the cancel of the receive
    loop (Python 3.11), and the backplane's own Redis connections stayed open after it."""
    process = Process(redis_url, prefix)
    fast = process.backplane
    await process.__aenter__()
    await fast.publish("wire:stop", DATA)  # takes a connection of the backplane's pool
    pool = fast.redis.connection_pool
    assert any(connection.is_connected for connection in [*pool._available_connections, *pool._in_use_connections])
    assert fast._receiver is not None
    fast._receiver.cancel()

    async def stubborn() -> None:  # what the receive loop does after a swallowed cancel
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(3600)

    fast._receiver = asyncio.get_running_loop().create_task(stubborn())
    await asyncio.sleep(0)
    async with asyncio.timeout(30):
        await fast.stop()
    assert not any(connection.is_connected for connection in [*pool._available_connections, *pool._in_use_connections])


async def test_calls_that_run_once_keep_their_book_on_redis_for_every_process(redis_url, prefix) -> None:
    """Two processes' Once rooms on one Redis: a key's first call runs on one, its repeat on
    the other waits for the answer; a claim lapses with its lease when its process dies."""
    from realtime_app.conf import DEFAULTS
    from realtime_app.conf.typed import Settings
    from realtime_app.hub.once import Once

    settings = Settings.from_config({**DEFAULTS, "LEASE_TTL_MS": 600})
    runs: list[str] = []

    async def execute(method: str, params: dict) -> tuple[bool, dict]:
        runs.append(method)
        await asyncio.sleep(0.3)
        return True, {"price": 110}

    async with Process(redis_url, prefix) as a, Process(redis_url, prefix) as b:
        once_a, once_b = Once(settings, lambda: a.backplane), Once(settings, lambda: b.backplane)
        alice = ("user", "1")
        answers = await asyncio.gather(
            once_a.run(alice, "k1", execute, "demo.bid", {}), once_b.run(alice, "k1", execute, "demo.bid", {})
        )
        assert answers == [(True, {"price": 110})] * 2 and runs == ["demo.bid"]
        assert once_a.probe()["ran"] + once_b.probe()["ran"] == 1
        name = Once.name(alice, "demo.bid", "k2")
        assert await a.backplane.claim_once(name, "dead", 600) == ("run", None)  # a process that died mid-call
        assert await b.backplane.claim_once(name, "other", 600) == ("running", None)
        assert await once_b.run(alice, "k2", execute, "demo.bid", {}) == (True, {"price": 110})  # after its lease
        assert runs == ["demo.bid", "demo.bid"]


def make_backplane(instance_id: str, config: dict) -> RedisBackplane | ShardedBackplane:
    if "REDIS_SHARDS" in config:
        return ShardedBackplane(instance_id=instance_id, config=config)
    return RedisBackplane(instance_id=instance_id, config=config)


def _clients_but_one(server: PrivateRedis) -> int:
    """Connections open on ``server`` but the one asking."""
    client = server.client()
    try:
        return len(client.client_list()) - 1
    finally:
        client.close()


@pytest.mark.parametrize("shards", [1, 2], ids=["one-server", "sharded"])
async def test_a_stop_cancelled_at_any_step_still_closes_every_connection(shards: int) -> None:
    """Found: a cluster's failover left a Redis connection open that nothing owned (a
    ResourceWarning when collected). A stop is itself cancelled — the caller's bound, the
    repeated cancel of :func:`cancel_and_wait` — and one cut inside its closing left the
    connections it had not closed yet open, in a pool nothing would close again. Each step
    of a stop cancelled in turn: every connection is closed all the same, before the
    backplane is collected, and no task is left."""
    from tests.support.cancelling import cancelled_after

    server = PrivateRedis().start()
    try:
        steps = 0
        while True:
            urls = [f"redis://127.0.0.1:{server.port}/{db}" for db in range(shards)]
            config = {"REDIS_SHARDS": urls} if shards > 1 else {"REDIS_URL": urls[0]}
            backplane = make_backplane(f"stop-{steps}", config)

            async def deliver(delivery: Delivery) -> None:
                pass

            await backplane.start(deliver)
            channels = [f"wire:stop{i}" for i in range(4)]  # (over both shards)
            await backplane.join(channels)
            await asyncio.gather(*(backplane.publish(c, DATA) for c in channels for _ in range(2)))  # a few connections
            assert await asyncio.to_thread(_clients_but_one, server) >= 2
            before = asyncio.all_tasks()
            finished = await cancelled_after(steps, backplane.stop())
            assert not (asyncio.all_tasks() - before), f"a task left by a stop cancelled after {steps} steps"

            async def closed() -> bool:  # (the server hears of each close a moment later)
                return await asyncio.to_thread(_clients_but_one, server) == 0

            await eventually(closed, 10, f"every connection closed by a stop cancelled after {steps} steps")
            if finished:
                break
            steps += 1
        assert steps >= 3  # the stop was cut at several places before it could finish
    finally:
        server.close()


async def test_calls_under_way_or_made_after_a_stop_open_no_connection() -> None:
    """Found by a review of the fix above: a call begun just before the stop (its connect
    under way, which the pool's close skips) or made after it (a request task cancelled
    once and still running) opened a socket in a pool that nothing closed again. Once
    stopped, the backplane opens no connection: such a call fails as an outage would."""
    server = PrivateRedis().start()
    try:
        for steps in range(8):
            backplane = RedisBackplane(instance_id=f"late-{steps}", config={"REDIS_URL": server.url})

            async def deliver(delivery: Delivery) -> None:
                pass

            await backplane.start(deliver)
            calls = [asyncio.get_running_loop().create_task(backplane.publish(f"wire:late{i}", DATA)) for i in range(4)]
            for _ in range(steps):
                await asyncio.sleep(0)
            await backplane.stop()
            await asyncio.gather(*calls, return_exceptions=True)
            with pytest.raises(backplane.errors):
                await backplane.publish("wire:late", DATA)

            async def closed() -> bool:
                return await asyncio.to_thread(_clients_but_one, server) == 0

            await eventually(closed, 10, f"no connection left by calls {steps} steps into the stop")
    finally:
        server.close()


async def test_one_identitys_idempotent_answers_on_redis_are_bounded_in_bytes(redis_url, prefix) -> None:
    """Found: a method echoing a 50 KB document kept 57.7 KB on Redis per anonymous call,
    149 MB per address over the TTL. An identity's answers kept through a process are now
    bounded in bytes (IDEMPOTENCY_MAX_BYTES_PER_IDENTITY): past it a new key is refused
    -32003 idempotency_full before it runs; its kept answers still answer their repeats."""
    from realtime_app.conf import DEFAULTS
    from realtime_app.conf.typed import Settings
    from realtime_app.hub.once import Once

    settings = Settings.from_config({**DEFAULTS, "IDEMPOTENCY_MAX_BYTES_PER_IDENTITY": 150_000})
    runs: list[str] = []

    async def echo(method: str, params: dict) -> tuple[bool, dict]:
        runs.append(params["k"])
        return True, {"doc": "x" * 50_000}

    async with Process(redis_url, prefix) as a:
        once = Once(settings, lambda: a.backplane)
        attacker, other = ("address", "198.51.100.9"), ("address", "198.51.100.10")
        answers = [await once.run(attacker, f"k{n}", echo, "demo.echo", {"k": f"k{n}"}) for n in range(4)]
        assert [ok for ok, _ in answers] == [True, True, True, False]  # 3 x 50 KB reach the bound
        refused = answers[3][1]
        assert (refused["code"], refused["data"]["reason"], refused["data"]["limit"]) == (
            -32003,
            "idempotency_full",
            150_000,
        )
        assert refused["data"]["retry_after_ms"] > 0 and runs == ["k0", "k1", "k2"]  # refused before it ran
        assert (await once.run(attacker, "k1", echo, "demo.echo", {"k": "k1"}))[0] is True  # a repeat: its answer
        assert runs == ["k0", "k1", "k2"]
        assert (await once.run(other, "k0", echo, "demo.echo", {"k": "o0"}))[0] is True  # another identity's own
        probe = once.probe()
        assert probe["refused_full"] == 1 and probe["kept_bytes"] >= 4 * 50_000
        stored = [k for k in redis.Redis.from_url(redis_url).scan_iter(f"{prefix}*once*")]
        assert len(stored) == 4 + 1  # 3 + 1 answers, and the refusal kept until it may come back


async def test_a_channel_only_read_keeps_its_keys_for_its_history_ttl_not_a_day(redis_url, prefix) -> None:
    """Found: each fresh instance a subscribe named left its count and epoch on Redis for
    24 h (2 keys, 328 B): one address churning rooms held about 765 MB. A read now keeps
    them for the channel's own history TTL; a publication still keeps them a day."""
    client = redis.Redis.from_url(redis_url)
    policy = HistoryPolicy(10, 60)  # 60 s
    async with Process(redis_url, prefix) as a:
        keys = [a.backplane.key("seq", "wire:room:fresh"), a.backplane.key("epoch", "wire:room:fresh")]
        first = await a.backplane.history("wire:room:fresh", policy)
        assert first.created and first.top == 0
        assert all(0 < client.pttl(key) <= 60_000 for key in keys), [client.pttl(k) for k in keys]
        again = await a.backplane.history("wire:room:fresh", policy)
        assert not again.created and again.epoch == first.epoch  # read again: the same lineage
        seq = await a.backplane.publish("wire:room:fresh", DATA, history=policy)
        assert all(client.pttl(key) > 3_600_000 for key in keys)  # published: its lineage lives a day
        after = await a.backplane.history("wire:room:fresh", policy)
        assert (after.epoch, after.top, after.created) == (first.epoch, seq, False)
        assert all(client.pttl(key) > 3_600_000 for key in keys)  # a read never shortens it
    client.close()
