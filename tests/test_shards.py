"""The backplane over three Redis servers (private ones, started here) and two daphne
processes: channels spread over the shards, and losing one shard stops its channels only.

docs/capacity.md describes the rule (each channel's keys on the shard channels-redis'
hash picks; the cluster's own state on the first, the home shard).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

import pytest

from realtime_app.cluster.shards import shard_of
from realtime_app.wire.names import group_name
from tests.private_redis import PrivateRedis
from tests.servers import ROOT, servers
from tests.support.waiting import eventually
from tests.wsclient import RPC

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

PREFIX = "shards"
SHARDS = 3


def test_a_channel_lives_where_channels_redis_would_put_it():
    """The rule is channels-redis' own (its private ``_consistent_hash``, pinned here: the
    code keeps a copy, so that the shard of a channel never depends on another package's
    private name)."""
    from channels_redis.utils import _consistent_hash

    names = [f"demo:clock:{ms}" for ms in range(100, 5000, 7)] + [f"room:{i}" for i in range(500)]
    for shards in (1, 2, 3, 5, 8):
        assert [shard_of(n, shards) for n in names] == [_consistent_hash(group_name(n), shards) for n in names]
        assert set(shard_of(n, shards) for n in names) == set(range(shards))  # every shard gets some


async def test_a_redis_cluster_node_is_refused_with_a_clear_message(tmp_path):
    """Redis Cluster is not used (a channel's keys are on one plain server, or Sentinel
    service, of REDIS_SHARDS): a node in cluster mode is an outage that says so."""
    from realtime_app.cluster.redis import ClusterModeRefused, RedisBackplane

    node = PrivateRedis("--cluster-enabled", "yes", "--cluster-config-file", str(tmp_path / "nodes.conf")).start()
    backplane = RedisBackplane(config={"REDIS_URL": node.url, "KEY_PREFIX": PREFIX})
    try:
        with pytest.raises(ClusterModeRefused, match="Redis Cluster node.*REDIS_SHARDS"):
            await backplane.check()
        assert isinstance(ClusterModeRefused("x"), backplane.errors)  # down, logged once: not a crash
    finally:
        await backplane.stop()
        node.close()


def per_shard(candidates: list[str]) -> list[str]:
    """One channel of ``candidates`` on each shard, in shard order."""
    chosen = {}
    for name in candidates:
        chosen.setdefault(shard_of(name, SHARDS), name)
    assert sorted(chosen) == list(range(SHARDS)), chosen
    return [chosen[i] for i in range(SHARDS)]


CLOCKS = per_shard([f"demo:clock:{ms}" for ms in range(200, 1000, 50)])
KEPT = per_shard([f"test:kept-{n}" for n in range(24)])


@pytest.fixture
def shards():
    started = [PrivateRedis().start() for _ in range(SHARDS)]
    yield started
    for server in started:
        server.close()


def env_for(shards: list[PrivateRedis], layer: str) -> dict[str, str]:
    return {
        "REALTIME_CHANNEL_LAYER": layer,
        "REDIS_URL": ",".join(s.url for s in shards),
        "REALTIME_KEY_PREFIX": PREFIX,
        "REALTIME_LEASE_TTL_MS": "1500",
    }


class Reader:
    """A client of one process subscribed to channels, its frames collected with when."""

    def __init__(self, url: str, channels: list[str]) -> None:
        self.rpc = RPC(url)
        self.channels = channels
        self.frames: list[tuple[float, dict[str, Any]]] = []
        self.positions: dict[str, dict[str, Any]] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Reader:
        await self.rpc.__aenter__()
        for channel in self.channels:
            self.positions[channel] = await self.rpc.subscribe(channel)
        self._task = asyncio.get_running_loop().create_task(self._read())
        return self

    async def _read(self) -> None:
        with contextlib.suppress(Exception):
            async for raw in self.rpc.ws:
                message = json.loads(raw)
                if message.get("method") == "message":
                    self.frames.append((time.monotonic(), message["params"]))

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.rpc.__aexit__()

    def seqs(self, channel: str) -> list[int]:
        return [f["seq"] for _, f in self.frames if f["channel"] == channel]

    def after(self, channel: str, moment: float) -> bool:
        return any(t > moment and f["channel"] == channel for t, f in self.frames)


async def publish_from_a_command(env: dict[str, str], channel: str, data: dict[str, Any]) -> int:
    """``manage.py shell -c`` publishing one message, as an operator's script would."""
    code = f"from realtime_app import publish; print(publish({channel!r}, {data!r}))"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "manage.py",
        "shell",
        "-c",
        code,
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env},
        stdout=asyncio.subprocess.PIPE,
    )
    stdout, _ = await process.communicate()
    assert process.returncode == 0
    return int(stdout.decode().strip().splitlines()[-1])


@pytest.mark.parametrize(("killed", "layer"), [(2, "core"), (0, "pubsub")])
async def test_channels_spread_over_three_shards_and_losing_one_stops_only_its_channels(shards, killed, layer):
    env = env_for(shards, layer)
    clients = [s.client() for s in shards]
    with servers(2, env) as (a, b):
        async with Reader(a.ws, CLOCKS + KEPT) as ra, Reader(b.ws, CLOCKS + KEPT) as rb:
            await eventually(lambda: all(ra.seqs(c) and rb.seqs(c) for c in CLOCKS), 15, "every cadence ticking")
            for i, (clock, kept) in enumerate(zip(CLOCKS, KEPT, strict=True)):
                seq = await publish_from_a_command(env, kept, {"shard": i})
                await eventually(lambda k=kept, s=seq: s in ra.seqs(k) and s in rb.seqs(k), 10, f"{kept} on both")
                keys = {
                    "seq": f"{PREFIX}:seq:{group_name(clock)}",
                    "lease": f"{PREFIX}:lease:{group_name(clock)}",
                    "history": f"{PREFIX}:history:{group_name(kept)}",
                }
                for name, key in keys.items():  # on its own shard, and on no other
                    assert [bool(c.exists(key)) for c in clients] == [j == i for j in range(SHARDS)], (name, key)
            for clock in CLOCKS:  # one ticker per cadence: each seq once, the same on both processes
                common = sorted(set(ra.seqs(clock)) & set(rb.seqs(clock)))
                assert len(common) >= 2 and ra.seqs(clock) == sorted(set(ra.seqs(clock)))
            assert clients[0].zcard(f"{PREFIX}:instances") == 2  # the cluster's own state: the home shard

            # history and resume: published while a client was away, replayed by its resume
            kept = KEPT[(killed + 1) % SHARDS]
            position = ra.positions[kept]
            first = await publish_from_a_command(env, kept, {"n": 1})
            await publish_from_a_command(env, kept, {"n": 2})
            async with RPC(b.ws) as late:
                since = {"epoch": position["epoch"], "seq": first - 1}
                answer = (await late.call("subscribe", {"channel": kept, "since": since}))["result"]
                assert answer["recovered"] is True and answer["replayed"] == 2

            # one shard lost: its channels stop, the others' go on
            lost_clock, lost_kept = CLOCKS[killed], KEPT[killed]
            old_epoch = ra.positions[lost_kept]["epoch"]
            shards[killed].kill()
            down = time.monotonic()
            others = [c for i, c in enumerate(CLOCKS) if i != killed]
            await eventually(
                lambda: all(ra.after(c, down + 3) and rb.after(c, down + 3) for c in others),
                20,
                "the other shards' channels going on",
            )
            assert not ra.after(lost_clock, down + 1) and not rb.after(lost_clock, down + 1)
            healthy_kept = KEPT[(killed + 1) % SHARDS]
            seq = await publish_from_a_command(env, healthy_kept, {"during": True})
            await eventually(lambda: seq in ra.seqs(healthy_kept) and seq in rb.seqs(healthy_kept), 10, "published")

            shards[killed].start()  # back, empty
            back = time.monotonic()
            await eventually(
                lambda: ra.after(lost_clock, back) and rb.after(lost_clock, back), 20, "its channels by themselves"
            )
            seq = await publish_from_a_command(env, lost_kept, {"after": True})
            await eventually(lambda: seq in ra.seqs(lost_kept) and seq in rb.seqs(lost_kept), 10, "kept again")
            async with RPC(a.ws) as resuming:  # the epoch says what was lost
                since = {"epoch": old_epoch, "seq": 1}
                answer = (await resuming.call("subscribe", {"channel": lost_kept, "since": since}))["result"]
                assert answer["recovered"] is False and answer["epoch"] != old_epoch
            if killed != 0:  # the home shard's probes say which shard was down
                probes = [json.loads(p) for p in clients[0].mget(clients[0].keys(f"{PREFIX}:probe:*"))]
                assert all(p["backplane"]["shards"][killed]["outages"] >= 1 for p in probes)
                assert all(len(p["backplane"]["shards"]) == SHARDS for p in probes)
