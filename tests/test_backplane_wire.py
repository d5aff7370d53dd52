"""The Redis backplane's own group send and receive speak channels-redis 4.3's storage
format exactly: a publication's Lua call stores, for each member of the channel's group,
what the layer's ``group_send`` would, and the process's member takes the layer's own
messages. Real Redis, a real ``RedisChannelLayer``."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
import redis
from channels_redis.core import RedisChannelLayer

from realtime_app.backplane import Delivery
from realtime_app.backplane_redis import FRAME, RELEASED, RedisBackplane, group_send_inline
from realtime_app.conf import DEFAULTS
from realtime_app.history import HistoryPolicy
from realtime_app.names import group_name
from realtime_app.protocol import notification_text

DATA = '{"n":1,"s":"caf\\u00e9"}'


@pytest.fixture
async def wire(redis_url: str) -> AsyncIterator[tuple[RedisChannelLayer, str]]:
    """A channels-redis layer under a prefix of this test's own; its keys deleted after."""
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-wire-{secrets.token_hex(3)}"
    layer = RedisChannelLayer(hosts=[redis_url], prefix=f"{prefix}:asgi")
    yield layer, prefix
    await layer.close_pools()
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    client.close()


def backplane(layer: RedisChannelLayer, prefix: str, **config: Any) -> RedisBackplane:
    return RedisBackplane(
        instance_id=f"wire-{secrets.token_hex(2)}", layer=layer, config={"KEY_PREFIX": prefix, **config}
    )


async def received(layer: RedisChannelLayer, channel: str) -> dict[str, Any]:
    async with asyncio.timeout(5):
        return await layer.receive(channel)


def stamp(text: str) -> int:
    return int(json.loads(text)["params"]["ts"])


async def test_a_publication_is_stored_for_a_plain_member_as_the_layers_group_send_stores_it(wire) -> None:
    layer, prefix = wire
    fast, slow = backplane(layer, prefix), backplane(layer, prefix)
    slow.inline_group_send = False  # the layer's own group_send after the numbering call
    assert fast.inline_group_send
    await layer.group_add(group_name("wire:a"), "plain.member")
    try:
        for bp in (fast, slow):
            seq = await bp.publish("wire:a", DATA)
            message = await received(layer, "plain.member")
            text = message["text"]
            assert message == {"type": FRAME, "channel": "wire:a", "text": text, "seq": seq}
            assert text == notification_text("wire:a", DATA, seq, stamp(text))
            assert abs(stamp(text) - time.time() * 1000) < 60_000
    finally:
        await fast.stop()
        await slow.stop()


async def test_the_stored_entry_is_channels_redis_own_packing_with_its_expiry(wire, redis_url) -> None:
    layer, prefix = wire
    fast = backplane(layer, prefix)
    await layer.group_add(group_name("wire:raw"), "plain.member")
    client = redis.Redis.from_url(redis_url, single_connection_client=True)
    key = f"{layer.prefix}plain.member"
    try:
        before = time.time()
        seq = await fast.publish("wire:raw", DATA)
        [(raw, score)] = client.zrange(key, 0, -1, withscores=True)
        message = msgpack.unpackb(raw[layer._serializer.random_prefix_length :])
        text = message["text"]
        expected = {
            "type": FRAME,
            "channel": "wire:raw",
            "text": text,
            "seq": seq,
            "__asgi_channel__": ["plain.member"],
        }
        assert message == expected
        assert before - 5 < score < time.time() + 5  # Redis' clock, on this machine
        assert layer.expiry - 2 <= client.ttl(key) <= layer.expiry
    finally:
        await fast.stop()
        client.close()


async def test_concurrent_publications_pop_in_seq_order(wire) -> None:
    layer, prefix = wire
    layer.capacity = 1000
    fast = backplane(layer, prefix)
    await layer.group_add(group_name("wire:order"), "plain.member")
    try:
        seqs = await asyncio.gather(*(fast.publish("wire:order", DATA) for _ in range(200)))
        popped = [(await received(layer, "plain.member"))["seq"] for _ in range(200)]
        assert sorted(seqs) == popped == list(range(1, 201))
    finally:
        await fast.stop()


async def test_a_kept_publication_carries_its_epoch_to_a_plain_member(wire) -> None:
    layer, prefix = wire
    fast = backplane(layer, prefix)
    await layer.group_add(group_name("wire:kept"), "plain.member")
    try:
        seq = await fast.publish("wire:kept", DATA, history=HistoryPolicy(10, 60_000))
        message = await received(layer, "plain.member")
        epoch = message["epoch"]
        assert len(epoch) == 19
        assert message == {"type": FRAME, "channel": "wire:kept", "text": message["text"], "seq": seq, "epoch": epoch}
        assert message["text"] == notification_text("wire:kept", DATA, seq, stamp(message["text"]), epoch)
        read = await fast.history("wire:kept", HistoryPolicy(10, 60_000))
        assert (read.epoch, read.top) == (epoch, seq)
    finally:
        await fast.stop()


async def test_a_process_local_member_gets_it_through_the_layers_receive(wire) -> None:
    """A process of an earlier version joined with a ``specific.…!…`` channel: the
    message goes to that process's key and names the channel it is for."""
    layer, prefix = wire
    fast = backplane(layer, prefix)
    local = await layer.new_channel()
    await layer.group_add(group_name("wire:b"), local)
    try:
        seq = await fast.publish("wire:b", DATA)
        message = await received(layer, local)
        assert (message["channel"], message["seq"]) == ("wire:b", seq)
    finally:
        await fast.stop()


async def test_a_member_over_capacity_misses_frames_logged_once_until_it_catches_up(wire, caplog) -> None:
    layer, prefix = wire
    layer.capacity = 3
    fast = backplane(layer, prefix)
    await layer.group_add(group_name("wire:c"), "plain.member")
    caplog.set_level(logging.WARNING, logger="realtime_app.backplane")
    try:
        for _ in range(6):
            await fast.publish("wire:c", DATA)
        assert [(await received(layer, "plain.member"))["seq"] for _ in range(3)] == [1, 2, 3]
        assert len([r for r in caplog.records if "over the layer's capacity" in r.getMessage()]) == 1
        await fast.publish("wire:c", DATA)
        assert (await received(layer, "plain.member"))["seq"] == 7
        assert len([r for r in caplog.records if "takes frames again" in r.getMessage()]) == 1
    finally:
        await fast.stop()


async def test_expired_members_and_messages_are_dropped_as_the_layer_drops_them(wire, redis_url) -> None:
    layer, prefix = wire
    fast = backplane(layer, prefix)
    client = redis.Redis.from_url(redis_url, single_connection_client=True)
    group_key = layer._group_key(group_name("wire:d"))
    client.zadd(group_key, {"gone.member": time.time() - layer.group_expiry - 10, "plain.member": time.time()})
    stale = f"{layer.prefix}plain.member"
    client.zadd(stale, {b"x" * 12 + b"stale": time.time() - layer.expiry - 10})
    try:
        await fast.publish("wire:d", DATA)
        assert client.zscore(group_key, "gone.member") is None
        assert not client.exists(f"{layer.prefix}gone.member")
        assert (await received(layer, "plain.member"))["seq"] == 1
        assert client.zcard(stale) == 0
    finally:
        await fast.stop()
        client.close()


async def test_the_process_member_takes_the_layers_own_messages_and_its_publications_in_order(wire) -> None:
    layer, prefix = wire
    got: list[Delivery] = []

    async def deliver(delivery: Delivery) -> None:
        got.append(delivery)

    fast = backplane(layer, prefix)
    await fast.start(deliver)
    try:
        await fast.join(["wire:e"])
        for _ in range(30):
            await fast.publish("wire:e", DATA)
        await layer.group_send(group_name("wire:e"), {"type": RELEASED, "channel": "wire:e", "by": "another"})
        async with asyncio.timeout(10):
            while len(got) < 31:
                await asyncio.sleep(0.02)
        assert [d.seq for d in got[:30]] == list(range(1, 31))
        assert [(d.kind, d.channel) for d in got[30:]] == [("released", "wire:e")]
    finally:
        await fast.stop()


@pytest.mark.parametrize(
    ("layer_kwargs", "redis_url_setting", "inline"),
    [
        ({}, None, True),
        ({}, "same", True),
        ({}, "redis://127.0.0.1:6390/0", False),
        ({"hosts": ["redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/1"]}, None, False),
        ({"hosts": [{"address": "redis://127.0.0.1:6379"}]}, "redis://127.0.0.1:6379", True),
        ({"hosts": [{"address": "redis://127.0.0.1:6379", "db": 2}]}, None, False),
        ({"symmetric_encryption_keys": ["k" * 32]}, None, False),
        ({"serializer_format": "json"}, None, False),
    ],
)
def test_the_layers_group_send_follows_where_the_script_cannot_store_the_same_bytes(
    layer_kwargs: dict[str, Any], redis_url_setting: str | None, inline: bool
) -> None:
    url = "redis://127.0.0.1:6379/0"
    layer = RedisChannelLayer(**{"hosts": [url], **layer_kwargs})
    setting = url if redis_url_setting == "same" else redis_url_setting
    assert group_send_inline(layer, {**DEFAULTS, "REDIS_URL": setting}) is inline


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


async def test_the_list_of_live_processes_expires_with_the_last_probe(wire, redis_url) -> None:
    """Found: a cluster killed at once (SIGKILL) left ``<prefix>:instances`` in Redis for good."""
    layer, prefix = wire
    fast = backplane(layer, prefix)
    client = redis.Redis.from_url(redis_url, single_connection_client=True)
    try:
        await fast.put_probe({"instance": fast.instance_id}, 5000)
        assert 0 < client.pttl(f"{prefix}:instances") <= 5000
    finally:
        await fast.stop()
        client.close()


async def test_stopping_ends_a_receiver_that_swallowed_the_cancel_and_closes_the_pool(wire) -> None:
    """Found: a stop hung when redis-py's ``wait_for`` swallowed the cancel of the receive
    loop (Python 3.11), and the backplane's own Redis connections stayed open after it."""
    layer, prefix = wire
    fast = backplane(layer, prefix)

    async def deliver(_: Delivery) -> None:
        pass

    await fast.start(deliver)
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
