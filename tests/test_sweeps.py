"""Daphne's sweeps visit only what can be due (realtime_app.endpoint.sweeps), black-box on
a daphne process: idle WebSockets wait in the timing wheel and are still pinged when
their heartbeat is due (a client that stops answering is closed), closed connections are
still reaped; only the daphne releases the module knows are swept here (another keeps
daphne's own sweeps, its code untouched).

Found: daphne walked every connection once a second and again every 2 s; at 10,000 idle
connections that was half of the process's idle CPU (docs/performance.md)."""

from __future__ import annotations

import contextlib
import json

import pytest

from realtime_app.endpoint.sweeps import supported
from tests.support.servers import prepare_database, servers
from tests.support.waiting import eventually
from tests.support.wsclient import RPC, call_honouring_refusals


def test_only_known_daphne_releases_are_swept_here():
    assert supported("4.2.3") and supported("4.1.0")
    assert not supported("5.0.0") and not supported("3.0.2") and not supported("dev")


@pytest.mark.timeout(120)
async def test_idle_websockets_wait_for_their_ping_and_closed_ones_are_reaped(tmp_path):
    env = {
        **prepare_database(str(tmp_path / "db.sqlite3")),
        "REDIS_URL": "",
        "REALTIME_TEST_OVERRIDES": json.dumps({"HEARTBEAT_SECONDS": 2, "MAX_CONNECTIONS_PER_ADDRESS": 0}),
    }
    with servers(1, env, extra_args=["--ping-timeout", "3"]) as (server,):
        async with RPC(server.ws) as asker:
            idle = [RPC(server.ws, address=f"10.9.0.{n + 1}") for n in range(30)]
            for rpc in idle:
                await rpc.__aenter__()
            await asker.subscribe("demo:events")

            async def sweeps() -> dict:
                answer = await call_honouring_refusals(asker, "test.daphne_sweeps", {})
                return answer["result"]

            counts = await eventually(sweeps, 10, "the sweeps installed")
            assert counts["ping_interval"] == 2  # HEARTBEAT_SECONDS
            # every open WebSocket waits in the wheel (after its first tick), none is visited each tick
            counts = await eventually(lambda: _scheduled(sweeps, 31), 20, "the WebSockets in the wheel")
            assert counts["fresh"] <= 2, counts
            # a client that stops answering pings is closed (its ping came from the wheel),
            # and the closed ones are reaped (daphne's websocket_timeout is a day: only a
            # ping can close the silent one)
            silent = idle.pop()
            silent.ws.transport.pause_reading()
            for rpc in idle[:20]:
                await rpc.__aexit__(None, None, None)

            async def gone() -> bool:
                return (await sweeps())["connections"] <= 10  # 9 idle and the asker: the silent one is gone

            await eventually(gone, 30, "closed connections reaped, the silent one closed after its ping")
            silent.ws.transport.resume_reading()
            with contextlib.suppress(Exception):
                await silent.__aexit__(None, None, None)
            # those that answer are still open after several heartbeats
            for rpc in idle[20:]:
                assert "result" in await rpc.call("ping", {})
            for rpc in idle[20:]:
                await rpc.__aexit__(None, None, None)


async def _scheduled(sweeps, at_least: int) -> dict | None:
    counts = await sweeps()
    return counts if counts["scheduled"] >= at_least else None
