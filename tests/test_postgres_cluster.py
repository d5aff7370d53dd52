"""A cluster on PostgreSQL alone, black-box: two daphne processes of the demo site with
``DATABASE_URL`` on this run's PostgreSQL, ``REALTIME_BACKPLANE=postgres`` and no Redis
(the in-memory channel layer), through the demo's names: one ticker per cadence and its
failover, a post on one process delivered once on both (through the outbox of the durable
room), a resume on the other process, presence across processes, an idempotent bid sent
to both, the health probe listing both, and a database outage that heals by itself."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from realtime_app.wire.names import group_name
from tests.support.cluster import publish_from_a_command
from tests.support.postgres import TcpProxy, with_port
from tests.support.servers import Server, login, logout, servers
from tests.support.waiting import eventually
from tests.support.wsclient import RPC, call_honouring_refusals

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

LEASE_TTL_MS = 1500


def libpq(url: str) -> str:
    return url.replace("postgres://", "postgresql://", 1)


def environment(database_url: str) -> dict[str, str]:
    return {
        "DATABASE_URL": database_url,
        "REALTIME_BACKPLANE": "postgres",
        "REDIS_URL": "",  # no Redis anywhere: the in-memory channel layer
        "REALTIME_KEY_PREFIX": f"{os.environ['REALTIME_TEST_PREFIX']}-pgc-{secrets.token_hex(3)}",
        "REALTIME_LEASE_TTL_MS": str(LEASE_TTL_MS),
    }


@pytest.fixture
def pg_cluster(postgres) -> Iterator[tuple[list[Server], dict[str, str]]]:
    env = environment(postgres[1])
    with servers(2, env) as procs:
        yield procs, env


def lease_holder(database_url: str, prefix: str, channel: str) -> str | None:
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT value FROM realtime_app_bp_key WHERE scope = %s AND name = %s "
            "AND expires_at > realtime_app_bp_now()",
            [f"{prefix}:lease", group_name(channel)],
        ).fetchone()
    return row[0] if row else None


async def test_one_ticker_per_cadence_in_the_cluster_and_it_moves_when_its_process_dies(pg_cluster):
    (a, b), env = pg_cluster
    channel = "demo:clock:200"
    async with RPC(a.ws) as ca:
        cb = await RPC(b.ws).__aenter__()
        await ca.subscribe(channel)
        await cb.subscribe(channel)
        fa, fb = await asyncio.gather(ca.frames(6), cb.frames(6))
        common = {f["seq"] for f in fa} & {f["seq"] for f in fb}
        assert len(common) >= 3, (fa, fb)  # the same publications on both processes
        for frames in (fa, fb):
            seqs = [f["seq"] for f in frames]
            assert seqs == sorted(set(seqs)), seqs  # in order, none twice
        holder = lease_holder(env["DATABASE_URL"], env["REALTIME_KEY_PREFIX"], channel)
        assert holder is not None
        victim, survivor, survivor_client = (a, b, cb) if f"-{a.process.pid}-" in holder else (b, a, ca)
        if survivor_client is ca:
            await cb.__aexit__(None, None, None)
        before = await survivor_client.frames(2)
        killed_at = time.time() * 1000
        victim.kill()
        after = await survivor_client.frames(5, timeout=LEASE_TTL_MS / 1000 * 3 + 10)
        seqs = [f["seq"] for f in before + after]
        assert seqs == sorted(set(seqs)), seqs  # the count goes on, never back, none twice
        assert any(f["ts"] > killed_at for f in after), after
        await eventually(
            lambda: (
                f"-{survivor.process.pid}-"
                in (lease_holder(env["DATABASE_URL"], env["REALTIME_KEY_PREFIX"], channel) or "")
            ),
            timeout=15,
            what="the lease on the survivor",
        )
        if survivor_client is cb:
            await cb.__aexit__(None, None, None)


async def test_a_post_on_one_process_reaches_both_once_and_a_client_resumes_on_the_other(pg_cluster):
    (a, b), env = pg_cluster
    cookie = login(a.http, "demo", "demo")
    room = f"pg{secrets.token_hex(3)}"
    channel = f"demo:room:{room}"
    async with RPC(a.ws) as wa, RPC(b.ws) as wb:
        first = await wa.subscribe(channel)
        await wb.subscribe(channel)
        async with RPC(a.ws, cookie=cookie) as poster:
            answer = await call_honouring_refusals(poster, "demo.post", {"room": room, "text": "hello"})
            assert "result" in answer, answer
        fa, fb = await asyncio.gather(wa.frames(1), wb.frames(1))
        assert fa == fb and fa[0]["data"] == {"user": "demo", "text": "hello"}
        assert fa[0]["seq"] == first["seq"] + 1 and fa[0]["epoch"] == first["epoch"]
    # away: five more posts on process a; back on process b with its position
    async with RPC(a.ws, cookie=cookie) as poster:
        for n in range(5):
            answer = await call_honouring_refusals(poster, "demo.post", {"room": room, "text": f"p{n}"})
            assert "result" in answer, answer
    since = {"seq": fa[0]["seq"], "epoch": fa[0]["epoch"]}
    async with RPC(b.ws) as back:
        await back.send(
            {"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": channel, "since": since}, "id": 1}
        )
        replayed: list[dict[str, Any]] = []
        while True:
            message = await back.recv(10)
            if message.get("method") == "message":
                replayed.append(message["params"])
            elif message.get("id") == 1:
                break
        if len(replayed) < 5:  # the last posts may still be on their way out of the outbox
            replayed += await back.frames(5 - len(replayed))
    assert [f["data"]["text"] for f in replayed] == [f"p{n}" for n in range(5)]
    assert [f["seq"] for f in replayed] == list(range(since["seq"] + 1, since["seq"] + 6))
    # a publication from a command (no server of its own) reaches both processes too
    async with RPC(a.ws) as ca, RPC(b.ws) as cb:
        await ca.subscribe("demo:events")
        await cb.subscribe("demo:events")
        seq = await publish_from_a_command(env, "demo:events", {"from": "shell"})
        fa, fb = await asyncio.gather(ca.frames(1), cb.frames(1))
        assert fa == fb and fa[0]["seq"] == seq and fa[0]["data"] == {"from": "shell"}
    with psycopg.connect(libpq(env["DATABASE_URL"]), autocommit=True) as conn:
        left = conn.execute("SELECT count(*) FROM realtime_app_outboxentry WHERE channel = %s", [channel]).fetchone()
    assert left == (0,)  # the outbox drained


async def test_presence_holds_members_of_both_processes_and_a_killed_ones_go(pg_cluster):
    (a, b), _ = pg_cluster
    channel = f"demo:room:pres{secrets.token_hex(3)}"
    cookie_a, cookie_b = login(a.http, "demo", "demo"), login(b.http, "admin", "admin")
    async with RPC(a.ws, cookie=cookie_a) as ta, RPC(b.ws, cookie=cookie_b) as tb:
        await ta.call("subscribe", {"channel": channel, "presence": True})
        await tb.call("subscribe", {"channel": channel, "presence": True})

        async def both() -> bool:
            for rpc in (ta, tb):
                members = (await rpc.call("presence", {"channel": channel}))["result"]["members"]
                if sorted(m["user"] for m in members) != ["admin", "demo"]:
                    return False
            return True

        await eventually(both, timeout=20, what="both members seen from both processes")
        b.kill()  # a crash: its member goes with its alive mark, within a lease and a beat

        async def only_demo() -> bool:
            members = (await ta.call("presence", {"channel": channel}))["result"]["members"]
            return [m["user"] for m in members] == ["demo"]

        await eventually(only_demo, timeout=20, what="the killed process's member gone")
    async with RPC(a.ws) as watcher:

        async def gone() -> bool:
            return (await watcher.call("presence", {"channel": channel}))["result"]["members"] == []

        await eventually(gone, timeout=20, what="the last member gone after its tab closed")


async def test_an_idempotent_bid_sent_to_both_processes_bids_once(pg_cluster):
    (a, b), _ = pg_cluster
    cookie = login(a.http, "demo", "demo")
    key = f"bid-{secrets.token_hex(4)}"
    lot = 900 + secrets.randbelow(100)
    async with RPC(a.ws, cookie=cookie) as ca, RPC(b.ws, cookie=cookie) as cb:
        before = (await ca.call("demo.bid", {"lot": lot, "amount": 1}))["result"]  # too low: a read
        params = {"lot": lot, "amount": before["price"] + 1000, "idempotency_key": key}
        first = await call_honouring_refusals(ca, "demo.bid", params)
        again = await call_honouring_refusals(cb, "demo.bid", params)
        assert "result" in first, first
        assert first["result"]["bids"] == before["bids"] + 1
        assert again["result"] == first["result"]  # answered from the cluster's book: bid once
        state = (await cb.call("demo.bid", {"lot": lot, "amount": 1}))["result"]
        assert state["bids"] == before["bids"] + 1


def health(server: Server, cookie: str) -> dict[str, Any]:
    request = urllib.request.Request(server.http + "/realtime/api/health", headers={"Cookie": cookie})
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


async def test_the_health_probe_lists_both_processes(pg_cluster):
    (a, b), _ = pg_cluster
    staff = login(a.http, "admin", "admin")
    async with RPC(a.ws), RPC(b.ws):

        def both() -> bool:
            probe = health(a, staff)
            return probe["clustered"] and {i["pid"] for i in probe["instances"]} == {a.process.pid, b.process.pid}

        await eventually(lambda: asyncio.to_thread(both), timeout=20, what="both processes listed")


@pytest.fixture
def cut_cluster(postgres) -> Iterator[tuple[list[Server], dict[str, str], TcpProxy]]:
    """The two processes reach PostgreSQL through a proxy of the test's own (the one it cuts)."""
    port = int(postgres[1].rsplit(":", 1)[1].split("/")[0])
    proxy = TcpProxy(port).restore()
    env = environment(with_port(postgres[1], proxy.port))
    try:
        with servers(2, env) as procs:
            yield procs, env, proxy
    finally:
        proxy.cut()


async def test_a_database_outage_heals_by_itself(cut_cluster, postgres):
    (a, b), env, proxy = cut_cluster
    async with RPC(a.ws) as ca, RPC(b.ws) as cb, RPC(b.ws) as clock:
        await ca.subscribe("demo:events")
        await cb.subscribe("demo:events")
        await clock.subscribe("demo:clock:200")
        await clock.frames(2)
        proxy.cut()
        await asyncio.sleep(3)  # an outage of a few seconds
        proxy.restore()
        direct = {**env, "DATABASE_URL": postgres[1]}

        async def delivered() -> bool:
            await publish_from_a_command(direct, "demo:events", {"after": "outage"})
            got = await asyncio.gather(ca.frames(1, timeout=3), cb.frames(1, timeout=3), return_exceptions=True)
            return all(isinstance(g, list) and g[0]["data"] == {"after": "outage"} for g in got)

        await eventually(delivered, timeout=60, what="a publication delivered to both after the outage")
        # the ticker ticks again
        healed_at = time.time() * 1000

        async def ticking() -> bool:
            return (await clock.frames(1, timeout=15))[0]["ts"] > healed_at

        await eventually(ticking, timeout=30, what="the clock ticking after the outage")


async def test_a_logout_on_one_process_closes_the_sessions_sockets_on_both(pg_cluster):
    (a, b), _ = pg_cluster
    cookie = login(a.http, "demo", "demo")
    async with RPC(a.ws, cookie=cookie) as on_a, RPC(b.ws, cookie=cookie) as on_b:
        for rpc in (on_a, on_b):
            await rpc.subscribe("atelier:load:500")  # signed-in users only
        assert logout(a.http, cookie) == 302
        assert await on_a.close_code(10) == 4001
        assert await on_b.close_code(10) == 4001  # told through the PostgreSQL backplane
