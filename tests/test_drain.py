"""Drain on SIGTERM (docs/deployment.md): the closes spread evenly over DRAIN_SECONDS, each
told when to come back; black-box on a daphne process: /realtime/ready answers 503, new
handshakes are turned away, every client is closed with 1012 and a retry_after_ms reason,
not all at once, the process exits, and the Python client waits what it was told.

Found: every deploy dropped every socket at once; nothing told the load balancer to stop
routing to a stopping process, and the survivors took the whole avalanche of handshakes."""

from __future__ import annotations

import asyncio
import json
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
from tests.support.wsclient import RPC


def test_the_closes_spread_evenly_and_each_is_told_when_to_come_back():
    plan = schedule(200, 20, random.Random(1))
    times = [at for at, _ in plan]
    assert times == sorted(times) and times[0] == 0 and times[-1] < 20 * DRAIN_SHARE
    assert times[100] == pytest.approx(20 * DRAIN_SHARE / 2)
    assert all(0 <= retry <= 80 for _, retry in plan)  # up to one spacing (80 ms) more
    assert schedule(0, 20) == [] and [at for at, _ in schedule(3, 0)] == [0, 0, 0]


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
async def test_sigterm_drains_the_connections_over_drain_seconds_then_the_process_exits(tmp_path):
    from realtime_app.client import RealtimeClient

    env = {
        **prepare_database(str(tmp_path / "db.sqlite3")),
        "REDIS_URL": "",
        "REALTIME_TEST_OVERRIDES": json.dumps({"DRAIN_SECONDS": 5, "MAX_CONNECTIONS_PER_ADDRESS": 0}),
    }
    with servers(1, env) as (server,):
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
        assert spread >= 5 / 2, spread  # over at least half of DRAIN_SECONDS, not all at once
        eventually_sync(lambda: server.process.poll() is not None, 15, "the process exits")
        # the Python client was told when to come back, and did not try before
        await eventually(lambda: closes, 10, "the python client closed")
        code, reason, again = closes[0]
        assert code == 1012 and again
        told = retry_after_ms(reason)
        closed_at = next(t for t, s in states if s == "reconnecting")
        await eventually(lambda: states[-1][1] in ("connecting", "reconnecting") and len(states) > 2, 10, "retry")
        tried_at = next(t for t, s in states if t > closed_at and s in ("connecting", "reconnecting"))
        assert tried_at - closed_at >= told / 1000 * 0.9, (tried_at - closed_at, told)
        await python.close()
        print(f"200 clients drained over {spread:.1f} s (DRAIN_SECONDS 5), {time.monotonic() - started:.1f} s")
        for rpc in clients:
            await rpc.__aexit__(None, None, None)
