"""Presence, black-box: two daphne processes of the demo site on Redis, through the names
of SPEC §12 (``demo:room:<slug:name>``, subscribe ``"presence": true``, notifications of
method ``presence``, RPC ``presence``). Two users with a tab on each process are two
members with two connections each; closing one tab changes only ``connections``; the last
tab's close is a ``left``; a process killed with SIGKILL takes its members with it within
lease + beat + interval; 500 joins and leaves in about a second reach a watcher as a
handful of notifications whose final member set is the truth."""

from __future__ import annotations

import json
import os
import random
import secrets
import time

import pytest
import redis

from realtime_app.wire.presence import apply
from tests.support.servers import login, prepare_database, servers
from tests.support.wsclient import RPC

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

INTERVAL_MS = 1000  # the default, as SPEC §12 names it
LEASE_MS = 3000


@pytest.fixture
def demo_cluster(redis_url, tmp_path):
    """Two daphne processes of the demo site on one SQLite file and the real Redis (a key
    prefix of their own, deleted after), presence at its default interval."""
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-presence-{secrets.token_hex(3)}"
    overrides = {"PRESENCE_INTERVAL_MS": INTERVAL_MS, "LEASE_TTL_MS": LEASE_MS}
    env = {
        **prepare_database(str(tmp_path / "db.sqlite3")),
        "REDIS_URL": redis_url,
        "REALTIME_KEY_PREFIX": prefix,
        "REALTIME_TEST_OVERRIDES": json.dumps(overrides),
    }
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    with servers(2, env) as procs:
        yield procs, client, prefix
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    client.close()


class Watcher:
    """A subscriber with ``"presence": true`` keeping the member set as the clients do."""

    def __init__(self, rpc: RPC, channel: str) -> None:
        self.rpc, self.channel = rpc, channel
        self.members: dict[str, dict] = {}
        self.count = 0
        self.frames: list[tuple[float, dict]] = []

    async def start(self) -> None:
        answer = await self.rpc.call("subscribe", {"channel": self.channel, "presence": True})
        assert answer["result"]["presence"] is True, answer
        # the reset came before the answer: RPC.call skipped it, so ask for the state once
        await self.until(lambda w: w.frames, timeout=5, catch_up=True)

    async def until(self, predicate, timeout: float = 15, catch_up: bool = False) -> float:
        """Read presence frames until ``predicate(self)``; returns when it became true."""
        deadline = time.monotonic() + timeout
        if catch_up and not self.frames:
            answer = await self.rpc.call("presence", {"channel": self.channel})
            self.members = {m["user"]: m for m in answer["result"]["members"]}
            self.count = answer["result"]["count"]
            self.frames.append((time.monotonic(), {"reset": True, **answer["result"]}))
        while not predicate(self):
            left = deadline - time.monotonic()
            assert left > 0, f"not within {timeout} s: {self.members}, count {self.count}"
            try:
                message = await self.rpc.recv(timeout=left)
            except TimeoutError:
                continue
            if isinstance(message, dict) and message.get("method") == "presence":
                self.members = apply(self.members, message["params"])
                self.count = message["params"]["count"]
                self.frames.append((time.monotonic(), message["params"]))
        return time.monotonic()


def connections(watcher: Watcher) -> dict[str, int]:
    return {user: m["connections"] for user, m in watcher.members.items()}


async def test_members_across_processes_tabs_and_a_killed_process(demo_cluster):
    (a, b), client, prefix = demo_cluster
    demo, admin = login(a.http, "demo", "demo"), login(a.http, "admin", "admin")
    room = "demo:room:presence"
    async with RPC(a.ws) as watching:
        watcher = Watcher(watching, room)
        await watcher.start()
        demo_a, demo_b = RPC(a.ws, cookie=demo), RPC(b.ws, cookie=demo)
        admin_a, admin_b = RPC(a.ws, cookie=admin), RPC(b.ws, cookie=admin)
        for tab in (demo_a, demo_b, admin_a, admin_b):
            await tab.__aenter__()
            await tab.subscribe(room)
        await watcher.until(lambda w: connections(w) == {"demo": 2, "admin": 2})
        assert watcher.count == 3  # two members, and the anonymous watcher
        assert (await watching.call("presence", {"channel": room}))["result"]["members"] == [
            {"user": "admin", "connections": 2},
            {"user": "demo", "connections": 2},
        ]

        await demo_b.__aexit__(None, None, None)  # one tab of two: connections only
        await watcher.until(lambda w: connections(w) == {"demo": 1, "admin": 2})
        assert not any("demo" in params.get("left", ()) for _, params in watcher.frames)

        closed = time.monotonic()
        await demo_a.__aexit__(None, None, None)  # the last tab: a left
        left_at = await watcher.until(lambda w: "demo" not in w.members)
        assert "demo" in watcher.frames[-1][1]["left"]
        print(f"last tab closed -> left seen on the other process's watcher in {left_at - closed:.2f} s")

        await admin_a.__aexit__(None, None, None)
        await watcher.until(lambda w: connections(w) == {"admin": 1})  # its tab on b remains
        [leases] = list(client.scan_iter(match=f"{prefix}:presence-until:*"))
        before = set(client.zrange(leases, 0, -1))
        assert len(before) == 2  # a's part and b's, each under its process's alive mark
        assert all(who.startswith("@") for who in before)
        killed = time.monotonic()
        b.kill()  # SIGKILL: no goodbye, its part goes with its mark (kill() waits for the exit)
        seconds, micros = client.time()
        now_ms = seconds * 1000 + micros // 1000
        last = {who: now_ms + client.pttl(f"{prefix}:presence-alive:{who[1:]}") for who in before}  # b's, final
        gone_at = await watcher.until(lambda w: "admin" not in w.members, timeout=30)
        seconds, micros = client.time()
        after = set(client.zrange(leases, 0, -1))
        [expired] = before - after  # b's part, and only it
        # Gone because its mark ran out — never before it, by Redis' own clock — and within
        # a generous deadline (the watcher's 30 s), not a wall-clock window here.
        assert seconds * 1000 + micros // 1000 >= last[expired]
        bound = (LEASE_MS + LEASE_MS / 3 + INTERVAL_MS) / 1000  # lease + beat + interval
        print(f"SIGKILL -> its members gone in {gone_at - killed:.2f} s (bound {bound:.1f} s)")
        assert watcher.count == 1
        # nothing of the killed process left on Redis: one part, the watcher's process's
        [key] = list(client.scan_iter(match=f"{prefix}:presence:*"))
        assert len(set(client.hkeys(key)) - {"~v"}) == 1
        await admin_b.ws.close()


async def test_500_joins_and_leaves_in_a_second_are_a_few_notifications_that_end_in_the_truth(demo_cluster):
    (a, b), _, _ = demo_cluster
    room = "demo:room:burst"
    demo, admin = login(a.http, "demo", "demo"), login(a.http, "admin", "admin")
    tabs = [RPC(a.ws if n % 2 else b.ws, address=f"10.9.{n // 250}.{n % 250 + 1}") for n in range(60)]
    tabs += [RPC(a.ws, cookie=demo), RPC(b.ws, cookie=demo), RPC(a.ws, cookie=admin), RPC(b.ws, cookie=admin)]
    for tab in tabs:
        await tab.__aenter__()
    async with RPC(a.ws) as watching:
        watcher = Watcher(watching, room)
        await watcher.start()
        rng = random.Random(7)
        inside = [False] * len(tabs)
        before = len(watcher.frames)
        t0 = time.monotonic()
        for _ in range(500):  # joins and leaves, each answered: as fast as the servers take them
            n = rng.randrange(len(tabs))
            method = "unsubscribe" if inside[n] else "subscribe"
            answer = await tabs[n].call(method, {"channel": room})
            assert "result" in answer, answer
            inside[n] = not inside[n]
        elapsed = time.monotonic() - t0
        users = {"demo": inside[-4] + inside[-3], "admin": inside[-2] + inside[-1]}
        truth = {user: k for user, k in users.items() if k}
        anonymous = sum(inside[:-4]) + 1  # and the watcher
        await watcher.until(lambda w: connections(w) == truth and w.count == len(truth) + anonymous)
        sent = len(watcher.frames) - before
        interval = INTERVAL_MS / 1000
        print(f"500 joins and leaves in {elapsed:.2f} s -> {sent} presence notifications")
        # one per interval at most, the changes of each interval coalesced: (elapsed / interval
        # + 1) while they happen, and one more for the last interval's changes
        assert sent <= elapsed / interval + 2, (sent, elapsed)
    for tab in tabs:
        await tab.__aexit__(None, None, None)


async def test_the_python_client_keeps_the_member_set_across_a_reconnect(demo_cluster):
    from realtime_app.client import RealtimeClient
    from tests.support.waiting import eventually

    (a, b), _, _ = demo_cluster
    room = "demo:room:client"
    demo = login(a.http, "demo", "demo")
    diffs: list[dict] = []
    async with RealtimeClient(b.ws, call_timeout=5) as client:
        client.on_presence.append(lambda channel, diff: diffs.append(diff))
        answer = await client.subscribe(room, lambda params: None, presence=True)
        assert answer["presence"] is True
        assert diffs and diffs[0]["reset"] is True  # every member first, then the diffs
        async with RPC(a.ws, cookie=demo) as tab:
            await tab.subscribe(room)
            await eventually(lambda: "demo" in client.members(room), 10, "demo in the room")
            await client.reconnect()  # a blip: subscribed again, the set starts from a reset
            await eventually(lambda: client.state == "open" and "demo" in client.members(room), 10, "back")
            assert sum(1 for d in diffs if d.get("reset")) == 2
        await eventually(lambda: "demo" not in client.members(room), 10, "demo gone")
        assert client.members(room) == {}
