"""Durable channels black-box: two daphne processes on PostgreSQL and a private Redis.
Posts committed while Redis is stopped all go out once it is back, once each, in commit
order, with consecutive seqs; a process killed right after its commits loses none and
duplicates none (the other process drains what it left)."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import websockets

from tests.support.private_redis import PrivateRedis
from tests.support.servers import login, servers
from tests.support.wsclient import RPC, call_honouring_refusals

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture
def outbox_cluster(postgres):
    """Two daphne processes on this run's PostgreSQL and a Redis of the test's own that
    keeps its data across a stop (append-only file): the one the test stops."""
    redis = PrivateRedis("--appendonly", "yes", "--appendfsync", "always").start()
    env = {"DATABASE_URL": postgres[1], "REDIS_URL": redis.url, "REALTIME_KEY_PREFIX": f"obx-{secrets.token_hex(3)}"}
    try:
        with servers(2, env) as procs:
            yield procs, redis
    finally:
        redis.close()


async def _resume(url: str, channel: str, since: dict) -> tuple[list[dict], dict]:
    """A subscribe ``since``: the frames it replays, and its answer."""
    async with RPC(url) as rpc:
        request = {"channel": channel, "since": since}
        await rpc.send({"jsonrpc": "2.0", "method": "subscribe", "params": request, "id": 1})
        frames = []
        while True:
            message = await rpc.recv(10)
            if message.get("method") == "message":
                frames.append(message["params"])
            elif message.get("id") == 1:
                assert "result" in message, message
                return frames, message["result"]


async def published_after(url: str, channel: str, seq: int, count: int, timeout: float = 60) -> list[dict]:
    """What the channel's history holds after ``seq`` — in its current epoch: a Redis that
    restarted starts a new one, its seqs going on — once ``count`` publications are there
    (polled with a deadline: the drain publishes when it can)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        async with RPC(url) as rpc:
            now = await rpc.subscribe(channel)
        if now["seq"] >= seq + count or asyncio.get_running_loop().time() > deadline:
            frames, _ = await _resume(url, channel, {"seq": seq, "epoch": now["epoch"]})
            return frames
        await asyncio.sleep(0.5)


async def test_posts_committed_while_redis_is_stopped_all_go_out_once_in_order(outbox_cluster):
    (a, b), redis = outbox_cluster
    cookie = login(a.http, "demo", "demo")
    room = f"outage{secrets.token_hex(3)}"
    channel = f"demo:room:{room}"
    async with RPC(b.ws) as watcher:
        first = await watcher.subscribe(channel)
    redis.stop()
    try:
        async with RPC(a.ws, cookie=cookie) as poster:
            for n in range(40):  # five a second: the method's own rate
                answer = await call_honouring_refusals(poster, "demo.post", {"room": room, "text": f"p{n}"})
                assert "result" in answer, answer  # committed, Redis or not
    finally:
        redis.start()
    frames = await published_after(b.ws, channel, first["seq"], 40)
    assert [f["data"]["text"] for f in frames] == [f"p{n}" for n in range(40)]  # in commit order, once each
    assert [f["seq"] for f in frames] == list(range(first["seq"] + 1, first["seq"] + 41))


async def test_a_process_killed_after_its_commits_loses_none_and_duplicates_none(outbox_cluster):
    (a, b), _ = outbox_cluster
    channel = "test:durable"
    async with RPC(b.ws) as watcher:
        first = await watcher.subscribe(channel)
    async with RPC(a.ws) as doomed:
        await doomed.send(
            {"jsonrpc": "2.0", "method": "test.commit_and_die", "params": {"channel": channel, "count": 30}, "id": 1}
        )
        with pytest.raises(websockets.ConnectionClosed):  # the process dies: the socket with it
            while True:
                await doomed.recv(30)
    assert a.process is not None and a.process.wait(30) == -9
    frames = await published_after(b.ws, channel, first["seq"], 30)  # the survivor drained what was left
    assert [f["data"]["n"] for f in frames] == list(range(30))
    assert [f["seq"] for f in frames] == list(range(first["seq"] + 1, first["seq"] + 31))


def _outbox_backends(database_url: str) -> dict[int, object]:
    """The server backends of this database whose last query was on the outbox: pid → when
    it started (one per beat on a connection kept open)."""
    import psycopg

    with psycopg.connect(database_url.replace("postgres://", "postgresql://", 1), autocommit=True) as db:
        rows = db.execute(
            "SELECT pid, query_start FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND query LIKE %s",
            ["%realtime_app_outboxentry%"],
        ).fetchall()
    return dict(rows)


async def beats_on_one_connection(database_url: str, beats: int, not_on: int | None = None, timeout: float = 30) -> int:
    """Poll (deadline) until one backend — not ``not_on`` — has answered ``beats`` outbox
    queries; its pid."""
    seen: dict[int, set[object]] = {}
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        for pid, started in (await asyncio.to_thread(_outbox_backends, database_url)).items():
            seen.setdefault(pid, set()).add(started)
            if pid != not_on and len(seen[pid]) >= beats:
                return pid
        assert asyncio.get_running_loop().time() < deadline, f"no connection kept for {beats} beats: {seen}"
        await asyncio.sleep(0.1)


async def test_a_process_asks_its_outbox_each_beat_on_one_connection_and_a_new_one_after_a_failure(postgres):
    """Found: each beat's query went through ``database_sync_to_async``, which under Django's
    default ``CONN_MAX_AGE = 0`` closes the connection after it — every process started a
    PostgreSQL backend a second (and, on SQLite, spent a quarter of its idle CPU opening
    the file). A connection the database ends is replaced within the beat that finds it
    gone (asked once more, nothing said), and durable publications go out on it."""
    _, database = postgres
    with servers(1, {"DATABASE_URL": database}) as (a,):
        cookie = login(a.http, "demo", "demo")
        room = f"beats{secrets.token_hex(3)}"
        channel = f"demo:room:{room}"
        async with RPC(a.ws) as watcher:
            first = await watcher.subscribe(channel)  # the hub runs: its outbox drain beats
            held = await beats_on_one_connection(database, 4)
            await asyncio.to_thread(_terminate, database, held)
            await beats_on_one_connection(database, 3, not_on=held)
            async with RPC(a.ws, cookie=cookie) as poster:
                answer = await call_honouring_refusals(poster, "demo.post", {"room": room, "text": "after"})
                assert "result" in answer, answer
            frames = await published_after(a.ws, channel, first["seq"], 1)
        log = a.output()
    assert [f["data"]["text"] for f in frames] == ["after"]
    assert "not drained" not in log  # the beat after the kill asked again on a fresh connection, not failed


def _terminate(database_url: str, pid: int) -> None:
    import psycopg

    with psycopg.connect(database_url.replace("postgres://", "postgresql://", 1), autocommit=True) as db:
        assert db.execute("SELECT pg_terminate_backend(%s)", [pid]).fetchone() == (True,)
