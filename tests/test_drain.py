"""Drain on SIGTERM (docs/deployment.md): the closes spread evenly over DRAIN_SECONDS, each
told when to come back; black-box on a daphne process: /realtime/ready answers 503, new
handshakes are turned away, every client is closed with 1012 and a retry_after_ms reason,
not all at once, the process exits, and the Python client waits what it was told.

Found: every deploy dropped every socket at once; nothing told the load balancer to stop
routing to a stopping process, and the survivors took the whole avalanche of handshakes."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import urllib.error
import urllib.request

import pytest
import websockets

from realtime_app.client.reconnecting import retry_after_ms
from realtime_app.endpoint.drain import DRAIN_SHARE, schedule
from tests.support.servers import prepare_database, servers
from tests.support.waiting import eventually, eventually_sync
from tests.support.wsclient import RPC, call_honouring_refusals


def test_the_closes_spread_evenly_and_each_is_told_when_to_come_back():
    plan = schedule(200, 20, random.Random(1))
    times = [at for at, _ in plan]
    assert times == sorted(times) and times[0] == 0 and times[-1] < 20 * DRAIN_SHARE
    assert times[100] == pytest.approx(20 * DRAIN_SHARE / 2)
    assert all(0 <= retry <= 80 for _, retry in plan)  # up to one spacing (80 ms) more
    assert max(retry for _, retry in plan) > 60  # spread over it, in ms (seeded: exact run to run)
    crowded = [retry for _, retry in schedule(1000, 10, random.Random(1))]  # 8 ms apart: at least 50 ms
    assert 8 < max(crowded) <= 50
    assert schedule(0, 20) == [] and [at for at, _ in schedule(3, 0)] == [0, 0, 0]
    assert [at for at, _ in schedule(3, -5)] == [0, 0, 0]  # no window: all at once, never "before"


class Longest(random.Random):
    """An rng whose every draw is the top of its range."""

    def uniform(self, a: float, b: float) -> float:
        return b


def test_each_is_told_up_to_one_spacing_in_milliseconds_at_least_50():
    assert schedule(8, 10, Longest()) == [(float(i), 1000) for i in range(8)]  # 1 s apart: up to 1000 ms
    assert schedule(1, 10, Longest()) == [(0.0, 8000)]  # one connection: the whole window
    assert schedule(1000, 10, Longest())[1] == (0.008, 50)  # 8 ms apart: 50 ms all the same


async def test_the_drain_closes_each_connection_at_its_turn_on_a_fake_clock(hub, monkeypatch, caplog):
    """The drain itself, not only its schedule: with the clock its own (each sleep moves a
    fake clock by what was asked), 20 connections are closed at 0, 1, 2 … 19 spacings —
    exactly, whatever the machine is doing — each told its own ``retry_after_ms``.

    Found: only ``schedule()`` was tested exactly; a drain closing half at once and half at
    the end passed the live test's ``spread >= DRAIN_SECONDS / 2``."""
    from types import SimpleNamespace

    from realtime_app.endpoint import drain as drain_module
    from tests.support.asgi_client import Client

    now = [1000.0]
    real_sleep = asyncio.sleep

    async def sleep(delay: float) -> None:
        now[0] += max(delay, 0.0)
        await real_sleep(0)

    fake = SimpleNamespace(sleep=sleep, get_running_loop=lambda: SimpleNamespace(time=lambda: now[0]))
    monkeypatch.setattr(drain_module, "asyncio", fake)
    closed_at: list[float] = []
    forget = hub.forget

    def forgotten(conn: object) -> None:
        closed_at.append(now[0] - 1000.0)
        forget(conn)
        if len(closed_at) == 5:  # the 11th connection goes on its own before its turn: skipped, not the end
            rest = [c for c in hub.connections if not c.closed]  # the drain's order (a set, only shrunk)
            rest[5].guard.close(4010, "closed by staff")  # as the operations screen closes one
            forget(rest[5])

    monkeypatch.setattr(hub, "forget", forgotten)
    clients = [Client() for _ in range(20)]
    for client in clients:
        await client.__aenter__()
    try:
        await clients[0].call("subscribe", {"channel": "test:drift:1000"})  # a ticker this process runs
        held = lambda: getattr(hub.reconciler.channels.get("test:drift:1000"), "held", False)  # noqa: E731
        await eventually(held, 5, "its lease held here")
        yielded: list[list[str]] = []
        real_yield = hub.reconciler.yield_leases
        monkeypatch.setattr(hub.reconciler, "yield_leases", lambda: yielded.append(real_yield()) or yielded[-1])
        with caplog.at_level(logging.INFO, logger="realtime_app.hub"):
            assert await drain_module.drain(hub, 2) == 19  # one of the 20 gone on its own meanwhile
        assert hub.gate.draining and yielded == [["test:drift:1000"]]  # its ticker handed over first
        assert "draining 20 connection(s) over 1.6 s" in caplog.text
        spacing = 2 * DRAIN_SHARE / 20
        assert closed_at == pytest.approx([i * spacing for i in range(20) if i != 10])
        assert now[0] - 1000.0 == pytest.approx(19 * spacing + 0.4)  # then a margin: the 20 % left (at most 1 s)
        reasons = []
        for client in clients:  # past the ticker's frames, to the close
            while (message := await client.comm.receive_output(2))["type"] != "websocket.close":
                pass
            reasons.append(message)
        assert sorted(r["code"] for r in reasons) == [1012] * 19 + [4010]
        before = now[0]
        assert await drain_module.drain(hub, 7.5) == 0  # nobody left; its margin at the 1 s cap (not 1.5 s)
        assert now[0] - before == pytest.approx(1.0)
        assert all(0 <= retry_after_ms(r["reason"]) <= spacing * 1000 for r in reasons if r["code"] == 1012)
    finally:
        for client in clients:
            await client.__aexit__(None, None, None)


def test_a_close_reason_says_when_to_come_back():
    assert retry_after_ms("retry_after_ms=1500") == 1500
    assert retry_after_ms("going away") is None and retry_after_ms("") is None


def ready(base: str) -> int:
    try:
        with urllib.request.urlopen(f"{base}/realtime/ready", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return 0  # gone


@pytest.mark.cluster
@pytest.mark.timeout(120)
@pytest.mark.parametrize("server_kind", ["daphne", "uvicorn"])
async def test_sigterm_drains_the_connections_over_drain_seconds_then_the_process_exits(
    tmp_path, server_kind, monkeypatch
):
    from realtime_app.client import RealtimeClient, reconnecting

    waits: list[float] = []  # what the Python client chose to wait before reconnecting

    class Watched:
        """The reconnecting module's ``asyncio``, its sleeps recorded."""

        def __getattr__(self, name: str) -> object:
            return getattr(asyncio, name)

        async def sleep(self, delay: float) -> None:
            waits.append(delay)
            await asyncio.sleep(delay)

    monkeypatch.setattr(reconnecting, "asyncio", Watched())

    env = {
        **prepare_database(str(tmp_path / "db.sqlite3")),
        "REDIS_URL": "",
        "REALTIME_TEST_OVERRIDES": json.dumps({"DRAIN_SECONDS": 5, "MAX_CONNECTIONS_PER_ADDRESS": 0}),
    }
    with servers(1, env, server=server_kind) as (server,):
        assert ready(server.http) == 200
        clients = [RPC(server.ws, address=f"10.8.{n // 250}.{n % 250 + 1}") for n in range(200)]
        for rpc in clients:
            await rpc.__aenter__()
            await rpc.subscribe("demo:events")
        closes: list[tuple[int | None, str, bool]] = []
        states: list[tuple[float, str]] = []
        python = RealtimeClient(server.ws, backoff_initial=0.01, backoff_max=0.02)
        python.on_close.append(lambda code, reason, again: closes.append((code, reason, again)))
        python.on_state.append(lambda state: states.append((time.monotonic(), state)))
        await python.connect()
        ended: list[tuple[float, int, str]] = []

        async def watch(rpc: RPC) -> None:
            try:
                while True:
                    await rpc.ws.recv()
            except websockets.ConnectionClosed as closed:
                rcvd = closed.rcvd
                ended.append((time.monotonic(), rcvd.code if rcvd else 1006, rcvd.reason if rcvd else ""))

        watchers = [asyncio.create_task(watch(rpc)) for rpc in clients]
        started = time.monotonic()
        server.process.terminate()  # SIGTERM
        await eventually(lambda: ready(server.http) == 503, 5, "/realtime/ready says draining")
        assert [ready(server.http) for _ in range(3)] == [503] * 3  # a load balancer keeps polling
        for _ in range(2):
            with pytest.raises(websockets.ConnectionClosed) as turned_away:
                async with websockets.connect(server.ws, origin=server.http) as late:
                    await asyncio.wait_for(late.recv(), 5)
            assert turned_away.value.rcvd.code == 1012
        await asyncio.wait_for(asyncio.gather(*watchers), 20)
        codes = [code for _, code, _ in ended]
        first = min(t for t, _, _ in ended)
        late = sorted(round(t - first, 2) for t, code, _ in ended if code != 1012)
        assert set(codes) == {1012}, ({code: codes.count(code) for code in set(codes)}, late[:10])
        assert all(retry_after_ms(reason) is not None for _, _, reason in ended)
        spread = max(t for t, _, _ in ended) - min(t for t, _, _ in ended)
        # not all at once (evenly, exactly: the fake-clock test above; a wall-clock bound
        # here would measure the machine)
        assert spread >= 1, spread
        eventually_sync(lambda: server.process.poll() is not None, 15, "the process exits")
        # the Python client was told when to come back, and did not try before
        await eventually(lambda: closes, 10, "the python client closed")
        code, reason, again = closes[0]
        assert code == 1012 and again
        told = retry_after_ms(reason)
        await eventually(lambda: states[-1][1] in ("connecting", "reconnecting") and len(states) > 2, 10, "retry")
        assert told is not None and waits[0] == told / 1000, (waits, told)  # what it was told, not its backoff
        await python.close()
        # a drain is a deploy, not an incident: no ERROR line for its 503s and refusals
        # (Django logs each 5xx it answers as one: the ready poll is answered before it)
        errors = [line for line in server.output().splitlines() if " ERROR " in line or line.startswith("ERROR")]
        assert errors == [], errors[:5]
        print(f"200 clients drained over {spread:.1f} s (DRAIN_SECONDS 5), {time.monotonic() - started:.1f} s")
        for rpc in clients:
            await rpc.__aexit__(None, None, None)


@pytest.mark.cluster
@pytest.mark.timeout(120)
async def test_a_draining_process_hands_its_ticker_over_at_once(redis_url):
    """SIGTERM on the process that runs a ticker: the other process, which has subscribers
    too, runs it within a second (a lease of 30 s would otherwise have to run out first;
    the beat is 10 s; the draining process's last subscriber leaves some 8 s later), with
    no tick published twice."""
    import os
    import secrets

    import redis

    from realtime_app.wire.names import group_name

    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-{secrets.token_hex(3)}"
    env = {
        "REDIS_URL": redis_url,
        "REALTIME_KEY_PREFIX": prefix,
        "REALTIME_LEASE_TTL_MS": "30000",
        "REALTIME_TEST_OVERRIDES": json.dumps({"DRAIN_SECONDS": 10, "MAX_CONNECTIONS_PER_ADDRESS": 0}),
    }
    channel = "demo:clock:200"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    lease = f"{prefix}:lease:{group_name(channel)}"
    try:
        with servers(2, env) as (a, b):
            async with RPC(a.ws) as ca, RPC(b.ws) as cb:
                await ca.subscribe(channel)
                await ca.frames(2)  # a holds the lease: it had the first subscriber
                more = [RPC(a.ws) for _ in range(20)]  # closed one by one over 8 s
                for rpc in more:
                    await rpc.__aenter__()
                    await rpc.subscribe(channel)
                await cb.subscribe(channel)
                before = await cb.frames(2)
                assert f"-{a.process.pid}-" in (client.get(lease) or "")
                asked = time.time() * 1000
                a.process.terminate()  # SIGTERM: a drains over 10 s
                await eventually(lambda: f"-{b.process.pid}-" in (client.get(lease) or ""), 5, "b holds the lease")
                handed = time.time() * 1000
                after = await cb.frames(5, timeout=10)
                seqs = [f["seq"] for f in before + after]
                assert seqs == sorted(set(seqs)), seqs  # never a tick twice, never backwards
                assert handed - asked < 3000, handed - asked  # not a lease timeout (30 s), nor a beat (10 s)
                resumed = [f["ts"] for f in after if f["ts"] > handed]
                assert resumed and resumed[0] - handed < 2000, (after, handed)
                print(f"ticker handed over {handed - asked:.0f} ms after SIGTERM")
                for rpc in more:
                    await rpc.__aexit__(None, None, None)
    finally:
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)


@pytest.mark.cluster
@pytest.mark.timeout(120)
async def test_clients_refused_a_resume_after_a_deploy_subscribe_again_when_told(tmp_path, redis_url):
    """Found by bench/deploy.py: after a process stopped at once, the clients that came back
    together were refused their resumes (too_many_resumes, retry_after_ms) and stayed
    connected to nothing: both clients now send a refused renewal again after the delay
    it names (the browser module's half is tests/js/client.test.mjs)."""
    import os
    import secrets

    import redis

    from realtime_app.client import RealtimeClient
    from realtime_app.exceptions import Refused

    overrides = {"MAX_CONCURRENT_RESUMES": 1, "MAX_CONNECTIONS_PER_ADDRESS": 0, "HANDSHAKES_PER_S": 0}
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-{secrets.token_hex(3)}"
    env = {
        **prepare_database(str(tmp_path / "db.sqlite3")),
        "REDIS_URL": redis_url,  # replays read Redis: resumes overlap as in production
        "REALTIME_KEY_PREFIX": prefix,
        "REALTIME_TEST_OVERRIDES": json.dumps(overrides),
    }
    with servers(1, env) as (server,):
        clients = [
            RealtimeClient(
                server.ws, headers={"X-Forwarded-For": f"10.7.0.{i + 1}"}, backoff_initial=0.01, backoff_max=0.05
            )
            for i in range(20)
        ]
        seen: list[set[int]] = [set() for _ in clients]
        refusals: list[Exception] = []
        for client, got in zip(clients, seen, strict=True):
            client.on_subscribe_error.append(lambda channel, error: refusals.append(error))
            await client.connect()
            await client.subscribe("demo:events", lambda params, got=got: got.add(params["data"]["n"]))
        async with RPC(server.ws, address="10.7.1.1") as publisher:
            burst = {"channels": ["demo:events"], "count": 200, "size": 3000}
            n = 0
            for _ in range(5):  # until some resume was refused: the case at hand
                away = [asyncio.create_task(client.reconnect(500)) for client in clients]
                await asyncio.sleep(0.05)
                await call_honouring_refusals(publisher, "test.publish_burst", {**burst, "start": n})
                n += 200  # published while they were away: each comes back with 200 to resume
                await asyncio.gather(*away)
                await eventually(lambda: all(c.state == "open" for c in clients), 20, "every client back")
                if any(isinstance(error, Refused) for error in refusals):
                    break
            assert any(isinstance(error, Refused) for error in refusals), refusals
            await call_honouring_refusals(publisher, "test.publish_burst", {**burst, "count": 1, "start": n})
            await eventually(lambda: all(n in got for got in seen), 30, "the next publication reaches every client")
        for client in clients:
            await client.close()
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
