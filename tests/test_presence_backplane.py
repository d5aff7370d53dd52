"""Presence on the backplane, the same contract on every one (memory, real Redis, shards
over two Redis databases): a part per process under its lease, a version that changes only
when what a reader sees does, a part that outlives its lease gone (a killed process), a
Redis that lost its keys refilled by the next write, and nothing left behind."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator

import pytest
import redis

from realtime_app.cluster.base import Backplane
from realtime_app.cluster.memory import MemoryBackplane
from realtime_app.cluster.redis import RedisBackplane
from realtime_app.cluster.shards import ShardedBackplane
from realtime_app.wire.presence import LocalRoom, merge
from tests.support.waiting import eventually


@pytest.fixture
async def prefix(redis_url: str) -> AsyncIterator[str]:
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-presence-{secrets.token_hex(3)}"
    yield prefix
    for db in (0, 1):
        client = redis.Redis.from_url(_db(redis_url, db))
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()


def _db(url: str, db: int) -> str:
    return url.rsplit("/", 1)[0] + f"/{db}" if url.count("/") > 2 else f"{url}/{db}"


def make(kind: str, redis_url: str, prefix: str, name: str) -> Backplane:
    config = {"KEY_PREFIX": prefix, "REDIS_URL": redis_url}
    if kind == "redis":
        return RedisBackplane(instance_id=name, config=config)
    shards = [_db(redis_url, 0), _db(redis_url, 1)]
    return ShardedBackplane(instance_id=name, config={**config, "REDIS_URL": None, "REDIS_SHARDS": shards})


def part(*users: str) -> str:
    room = LocalRoom()
    for n, user in enumerate(users):
        room.enter(n, user)
    return room.part(0)


@pytest.mark.parametrize("kind", ["redis", "shards"])
async def test_parts_of_two_processes_merge_and_a_dead_ones_go_with_its_lease(kind, redis_url, prefix):
    a, b = make(kind, redis_url, prefix, "a"), make(kind, redis_url, prefix, "b")
    rooms = [f"room:{n}" for n in range(6)]  # over both shards
    await a.start(_ignore)
    await b.start(_ignore)
    try:
        await a.put_presence({r: part("ann") for r in rooms}, 60_000)
        await b.put_presence({r: part("ann", "bob") for r in rooms}, 600)
        read = await a.read_presence({r: "" for r in rooms})
        for r in rooms:
            version, parts = read[r]
            assert merge(parts).users == {"ann": (2, None), "bob": (1, None)}
        versions = {r: read[r][0] for r in rooms}
        # the same part again renews it: a reader that holds the version reads nothing
        await a.put_presence({r: part("ann") for r in rooms}, 60_000)
        assert await a.read_presence(versions) == {r: None for r in rooms}

        # b is killed: nothing renews its part, gone after its lease (600 ms)
        async def bob_gone() -> bool:
            found = await a.read_presence(versions)
            return all(found[r] is not None and merge(found[r][1]).users == {"ann": (1, None)} for r in rooms)

        await eventually(bob_gone, 10, "b's part gone with its lease")
        # a leaves cleanly: nothing left on the backplane
        await a.put_presence({r: None for r in rooms}, 60_000)
        found = await a.read_presence({r: "" for r in rooms})
        assert all(merge(found[r][1]).count == 0 for r in rooms)
        for db in (0, 1):
            client = redis.Redis.from_url(_db(redis_url, db))
            assert list(client.scan_iter(match=f"{prefix}*presence*")) == []
            client.close()
    finally:
        await a.stop()
        await b.stop()


async def test_a_redis_that_lost_its_keys_is_refilled_by_the_next_write(redis_url, prefix):
    a = make("redis", redis_url, prefix, "a")
    await a.start(_ignore)
    try:
        await a.put_presence({"room": part("ann")}, 60_000)
        first = (await a.read_presence({"room": ""}))["room"]
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)  # only this test's keys: as if Redis restarted empty
        client.close()
        lost = (await a.read_presence({"room": first[0]}))["room"]
        assert lost is not None and merge(lost[1]).count == 0  # a changed version: read again, empty
        await a.put_presence({"room": part("ann")}, 60_000)  # the beat writes the part again
        back = (await a.read_presence({"room": lost[0]}))["room"]
        assert back is not None and merge(back[1]).users == {"ann": (1, None)}
    finally:
        await a.stop()


async def test_the_memory_backplane_keeps_the_same_contract():
    a = MemoryBackplane(instance_id="a")
    await a.put_presence({"room": part("ann")}, 200)
    version, parts = (await a.read_presence({"room": ""}))["room"]
    assert merge(parts).users == {"ann": (1, None)}
    await a.put_presence({"room": part("ann")}, 200)
    assert (await a.read_presence({"room": version}))["room"] is None

    async def gone() -> bool:  # past the lease, nothing renewed it
        found = (await a.read_presence({"room": version}))["room"]
        return found is not None and merge(found[1]).count == 0

    await eventually(gone, 5, "the part gone with its lease")


@pytest.mark.parametrize("kind", ["redis", "shards"])
async def test_a_process_marked_alive_keeps_its_parts_an_hour_and_takes_them_with_its_mark(kind, redis_url, prefix):
    """Found: 20,000 idle rooms kept daphne at 85 % of a core, each part written again every
    beat to renew a 3 s lease. A process marked alive (one key a beat, per shard) writes
    its parts to live an hour; readers drop them as soon as its mark lapses."""
    from realtime_app.cluster.base import PRESENCE_KEEP_MS

    a, b = make(kind, redis_url, prefix, "a"), make(kind, redis_url, prefix, "b")
    rooms = [f"room:{n}" for n in range(6)]
    await a.start(_ignore)
    await b.start(_ignore)
    try:
        assert await a.presence_alive(60_000) == (PRESENCE_KEEP_MS, False)  # a first mark: write everything
        assert await a.presence_alive(60_000) == (PRESENCE_KEEP_MS, True)
        assert await b.presence_alive(600) == (PRESENCE_KEEP_MS, False)
        await a.put_presence({r: part("ann") for r in rooms}, PRESENCE_KEEP_MS, alive=True)
        await b.put_presence({r: part("bob") for r in rooms}, PRESENCE_KEEP_MS, alive=True)
        read = await a.read_presence({r: "" for r in rooms})
        assert all(merge(read[r][1]).users == {"ann": (1, None), "bob": (1, None)} for r in rooms)
        ttls = []
        for db in (0, 1):
            client = redis.Redis.from_url(_db(redis_url, db))
            ttls += [client.pttl(key) for key in client.scan_iter(match=f"{prefix}*:presence:*")]
            client.close()
        assert ttls and all(ttl > 3_000_000 for ttl in ttls)  # an hour, not a lease
        c = make(kind, redis_url, prefix, "c")  # a process that writes leased parts (a Redis Cluster node's way)
        await c.start(_ignore)
        await c.put_presence({r: part("cy") for r in rooms}, 600)
        await c.put_presence({r: None for r in rooms}, 600)
        await c.stop()
        for db in (0, 1):  # its short lease never shortened the room: the others' parts stay
            client = redis.Redis.from_url(_db(redis_url, db))
            assert all(client.pttl(key) > 3_000_000 for key in client.scan_iter(match=f"{prefix}*:presence:*"))
            client.close()
        versions = {r: read[r][0] for r in rooms}

        async def bob_gone() -> bool:  # b stops marking itself: its mark lapses (600 ms), its parts go
            found = await a.read_presence(versions)
            return all(found[r] is not None and merge(found[r][1]).users == {"ann": (1, None)} for r in rooms)

        await eventually(bob_gone, 10, "b's parts gone with its mark")
        assert await b.presence_alive(600) == (PRESENCE_KEEP_MS, False)  # b back: told to write everything again
        await a.put_presence({r: None for r in rooms}, PRESENCE_KEEP_MS, alive=True)
        found = await a.read_presence({r: "" for r in rooms})
        assert all(merge(found[r][1]).count == 0 for r in rooms)
    finally:
        await a.stop()
        await b.stop()


async def _ignore(delivery: object) -> None:
    pass
