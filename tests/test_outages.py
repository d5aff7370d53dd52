"""The site while its Redis or its database is down, on real daphne processes: every
ordinary page and the admin answer, realtime says what is down and comes back by itself;
signed-in handshakes during a database outage get 1013, and the logs stay a few lines."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlparse

import pytest
import websockets

from tests.support.postgres import TcpProxy, with_port
from tests.support.servers import ROOT, Server, login
from tests.support.waiting import eventually, eventually_sync
from tests.support.wsclient import RPC, closed_with

pytestmark = pytest.mark.timeout(180)

CLUSTER_SCREEN = "/admin/realtime_app/realtimecluster/"


def get(url: str, cookie: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def subscribes(url: str, **connect: Any) -> bool:
    """A connection (``RPC``'s keyword arguments) subscribes to demo:clock; False while the
    server still turns it away (1013, or no answer)."""
    try:
        async with RPC(url, **connect) as rpc:
            return "result" in await rpc.call("subscribe", {"channel": "demo:clock"})
    except (websockets.ConnectionClosed, OSError):
        return False


def backplane_check(redis_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "REDIS_URL": redis_url}
    command = [sys.executable, "manage.py", "check", "--tag", "realtime_backplane"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("how", ["stopped", "misspelled"])
async def test_with_redis_down_every_page_answers_and_realtime_says_what_is_down(database, private_redis, how):
    """Found: an unreachable or misspelled Redis answered HTTP 500 on every page, /admin/
    and the login included (the hub's start ran in every request), and `check` passed."""
    if how == "stopped":
        private_redis.stop()
        redis_url = private_redis.url
    else:
        redis_url = "redis://redis-typo.invalid:6379/0"
    server = Server({**database, "REDIS_URL": redis_url}).start()
    try:
        assert get(server.http + "/")[0] == 200
        cookie = login(server.http, "admin", "admin")  # the login form: a POST, sessions, CSRF
        assert get(server.http + "/admin/", cookie)[0] == 200
        status, page = await asyncio.to_thread(
            eventually_sync,
            lambda: (lambda r: r if r[0] == 200 and "Realtime is down on this process" in r[1] else None)(
                get(server.http + CLUSTER_SCREEN, cookie)
            ),
            30,
            "the cluster screen saying the backplane is down",
        )
        assert "backplane unavailable" in page
        status, body = get(server.http + "/realtime/api/health", cookie)
        assert status == 503 and "unavailable" in json.loads(body)
        assert await closed_with(server.ws, cookie) == (1013, "backplane unavailable"), server.output()[-3000:]
        assert "Traceback" not in server.output()
        check = await asyncio.to_thread(backplane_check, redis_url)
        assert check.returncode != 0 and "realtime_app.E012" in check.stderr
        assert urlparse(redis_url).hostname in check.stderr
        if how == "stopped":  # Redis back: realtime comes back by itself, no restart
            private_redis.start()

            await eventually(lambda: subscribes(server.ws, cookie=cookie), 30, "a subscribe once Redis is back")
            assert (await asyncio.to_thread(backplane_check, redis_url)).returncode == 0
    finally:
        server.stop()


async def test_a_database_outage_refuses_signed_in_handshakes_with_1013_and_logs_a_few_lines(postgres):
    """Found: during a database outage signed-in handshakes answered HTTP 500 (20 of 20),
    and every re-validation round logged a traceback per signed-in socket."""
    server_url, database = postgres
    proxy = TcpProxy(urlparse(server_url).port or 5432).restore()
    overrides = {"REVALIDATE_INTERVAL_MS": 1000, "MAX_CONNECTIONS_PER_USER": 0, "HANDSHAKES_PER_S": 0}
    env = {
        "DATABASE_URL": with_port(database, proxy.port),
        "REDIS_URL": "",
        "REALTIME_TEST_OVERRIDES": json.dumps(overrides),
    }
    server = Server(env).start()
    sockets: list[RPC] = []
    try:
        cookie = login(server.http, "demo", "demo")
        for _ in range(300):  # signed-in sockets open before the outage
            rpc = RPC(server.ws, cookie=cookie)
            await rpc.__aenter__()
            sockets.append(rpc)
        proxy.cut()
        for _ in range(20):
            assert await closed_with(server.ws, cookie) == (1013, "database unavailable")
        log = server.output

        def revalidation_lines() -> list[str]:
            return [line for line in log().splitlines() if "re-validat" in line]

        # the first round that finds the database away: one line for all 300 sockets (it was a
        # traceback per socket per round)
        await eventually(lambda: revalidation_lines(), 20, "the re-validation says the database is away")
        during = log()
        assert len(revalidation_lines()) == 1, during[-4000:]
        assert "Traceback" not in during
        assert len([line for line in during.splitlines() if "handshake(s) closed with 1013" in line]) == 1
        assert [rpc.ws.close_code for rpc in sockets if rpc.ws.close_code] == []  # none lost its rights
        proxy.restore()
        await eventually(lambda: any("re-validation resumed" in line for line in revalidation_lines()), 20, "resumed")

        await eventually(lambda: subscribes(server.ws, cookie=cookie), 20, "a signed-in handshake accepted again")
    finally:
        for rpc in sockets:
            await rpc.__aexit__(None, None, None)
        server.stop()
        proxy.cut()


async def test_a_database_outage_answers_token_handshakes_1013_and_spares_token_sockets(postgres):
    """A token's user is read from the database too: during an outage its handshake is
    1013 (come back), never a final 4002; RPC ``auth`` says ``database_unavailable`` with
    when to come back; re-validation keeps the open token sockets, and after the outage a
    token connects again.

    Found: only the session path was tested, and RPC ``auth`` answered an outage with
    -32603 and a traceback per call."""
    server_url, database = postgres
    proxy = TcpProxy(urlparse(server_url).port or 5432).restore()
    overrides = {"REVALIDATE_INTERVAL_MS": 1000, "MAX_CONNECTIONS_PER_USER": 0, "HANDSHAKES_PER_S": 0}
    env = {
        "DATABASE_URL": with_port(database, proxy.port),
        "REDIS_URL": "",
        "REALTIME_TEST_OVERRIDES": json.dumps(overrides),
    }
    token = subprocess.run(  # noqa: ASYNC221 -- before the server starts: nothing else runs
        [sys.executable, "manage.py", "realtime_token", "demo"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    server = Server(env).start()
    sockets: list[RPC] = []
    try:
        for _ in range(3):  # token sockets open before the outage
            rpc = RPC(server.ws, token=token)
            await rpc.__aenter__()
            assert "result" in await rpc.call("subscribe", {"channel": "demo:clock"})
            sockets.append(rpc)
        proxy.cut()
        for _ in range(3):
            assert await closed_with(server.ws, token=token) == (1013, "database unavailable")
        async with RPC(server.ws) as anonymous:
            refused = await anonymous.call("auth", {"token": token})
        assert refused["error"]["data"]["reason"] == "database_unavailable", refused
        assert refused["error"]["data"]["retry_after_ms"] > 0
        await eventually(lambda: "re-validation paused" in server.output(), 20, "a round finds the database away")
        assert "Traceback" not in server.output()
        assert [rpc.ws.close_code for rpc in sockets if rpc.ws.close_code] == []  # none lost its rights
        assert [(await rpc.call("ping"))["result"] for rpc in sockets] == ["pong"] * 3
        proxy.restore()

        async def accepted() -> bool:
            try:
                async with RPC(server.ws, token=token) as rpc:
                    return (await rpc.call("inventory.snapshot"))["result"]["user"] == "demo"
            except (websockets.ConnectionClosed, OSError):
                return False  # still 1013: the pool's connections come back on their own

        await eventually(accepted, 20, "a token connects again after the outage")
    finally:
        for rpc in sockets:
            await rpc.__aexit__(None, None, None)
        server.stop()
        proxy.cut()
