"""realtime_app added to a Channels project of its own (tests/hostproject): the project's
consumers on both channels-redis layers, its JWT-style middleware in front of the app's auth
stack, its own per-object channel and rule — run under daphne, tried from outside.

Found: the redis-py the app required (8.x, whose sockets time out reads after 5 s) closed
the project's own idle channels-redis consumers with 1011 after 6-11 s; any Bearer header
made a session user anonymous and took its session (``channels.auth.login()`` then raised);
a user set by the outer middleware was replaced by an anonymous one; a misspelt rule left the
order channel open to everyone, with only a warning from ``check``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets

from tests.support.servers import ROOT, Server
from tests.support.waiting import eventually_sync
from tests.support.wsclient import RPC

pytestmark = [pytest.mark.timeout(300)]

#: How long the project's consumers sit idle: ten times what killed them.
IDLE_S = 65


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "django", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def host_env(tmp: Path, redis_url: str, pattern: str = "order:<int:id>") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}:host:{tmp.name}"
    env.update(
        DJANGO_SETTINGS_MODULE="tests.hostproject.settings",
        HOST_DATABASE=str(tmp / "db.sqlite3"),
        HOST_REDIS_URL=redis_url,
        HOST_KEY_PREFIX=prefix,
        HOST_ORDER_PATTERN=pattern,
    )
    return env


SETUP = """
from django.contrib.auth import get_user_model
from django.test import Client
from realtime_app.endpoint.tokens import issue
users = {name: get_user_model().objects.create_user(name, password=name * 3) for name in ("ann", "bob")}
client = Client()
client.force_login(users["ann"])
print(json.dumps({"cookie": "sessionid=" + client.cookies["sessionid"].value, "token": issue(users["ann"])[0]}))
"""


class Host:
    def __init__(self, server: Server, cookie: str, token: str, env: dict[str, str]) -> None:
        self.server, self.cookie, self.token, self.env = server, cookie, token, env

    def url(self, path: str) -> str:
        return f"ws://127.0.0.1:{self.server.port}/{path}"


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Host]:
    """The host project, migrated (users ann and bob), under daphne."""
    tmp = tmp_path_factory.mktemp("host")
    env = host_env(tmp, redis_url)
    assert manage(env, "migrate", "--noinput", "-v", "0").returncode == 0
    done = manage(env, "shell", "-c", "import json\n" + SETUP)
    assert done.returncode == 0, done.stderr
    made = json.loads(done.stdout.strip().splitlines()[-1])
    server = Server(env, app="tests.hostproject.asgi:application").start()
    try:
        yield Host(server, made["cookie"], made["token"], env)
    finally:
        server.stop()


async def hello(url: str, headers: dict[str, str] | None = None) -> tuple[object, dict[str, object]]:
    ws = await websockets.connect(url, additional_headers=headers or {}, open_timeout=10)
    return ws, json.loads(await asyncio.wait_for(ws.recv(), 10))


async def test_the_projects_own_consumers_stay_open_while_idle_on_both_channels_redis_layers(host: Host) -> None:
    from channels_redis.core import RedisChannelLayer
    from channels_redis.pubsub import RedisPubSubChannelLayer

    core, _ = await hello(host.url("chat/"))
    pubsub, _ = await hello(host.url("chat-pubsub/"))
    try:
        for ws in (core, pubsub):  # idle: nothing arrives, and the socket is not closed
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(ws.recv(), IDLE_S if ws is core else 1)  # type: ignore[attr-defined]
        hosts, prefix = [host.env["HOST_REDIS_URL"]], host.env["HOST_KEY_PREFIX"]
        layers = [(RedisChannelLayer(hosts=hosts, prefix=prefix), core)]
        layers.append((RedisPubSubChannelLayer(hosts=hosts, prefix=f"{prefix}:pubsub"), pubsub))
        try:
            for layer, ws in layers:  # the group still reaches them after the idle minute
                await layer.group_send("lobby", {"type": "chat.message", "text": "after a minute"})
                assert json.loads(await asyncio.wait_for(ws.recv(), 10)) == {"message": "after a minute"}  # type: ignore[attr-defined]
        finally:
            await layers[0][0].close_pools()
            await layers[1][0].flush()  # its connections (the keys are this run's, removed at its end)
    finally:
        await core.close()  # type: ignore[attr-defined]
        await pubsub.close()  # type: ignore[attr-defined]
    assert "Timeout reading" not in host.server.output()


async def test_a_foreign_bearer_leaves_the_session_and_its_user(host: Host) -> None:
    foreign = {"Cookie": host.cookie, "Authorization": "Bearer another-apis-key"}
    ws, me = await hello(host.url("chat/"), foreign)
    await ws.close()  # type: ignore[attr-defined]
    assert me == {"user": "ann", "session": True}  # before: anonymous, no session
    ws, me = await hello(host.url("chat/"), {"Authorization": "Bearer another-apis-key"})
    try:  # channels.auth.login() works on such a socket (before: "Cannot find session in scope")
        assert me == {"user": None, "session": True}
        await ws.send(json.dumps({"login": "bob"}))  # type: ignore[attr-defined]
        assert json.loads(await asyncio.wait_for(ws.recv(), 10)) == {"logged_in": {"user": "bob", "session": True}}  # type: ignore[attr-defined]
        await ws.send(json.dumps({"logout": True}))  # type: ignore[attr-defined]
        assert json.loads(await asyncio.wait_for(ws.recv(), 10)) == {"logged_out": {"user": None, "session": True}}  # type: ignore[attr-defined]
    finally:
        await ws.close()  # type: ignore[attr-defined]


async def test_a_user_set_by_the_projects_outer_middleware_is_kept(host: Host) -> None:
    ws, me = await hello(host.url("chat/"), {"Authorization": "Bearer jwt.bob"})
    await ws.close()  # type: ignore[attr-defined]
    assert me == {"user": "bob", "session": True}  # before: anonymous
    ws, me = await hello(host.url("chat/"), {"Authorization": "Bearer jwt.bob", "Cookie": host.cookie})
    await ws.close()  # type: ignore[attr-defined]
    assert me["user"] == "bob"
    async with _rpc(host.url("realtime/"), {"Authorization": "Bearer jwt.bob"}) as rpc:  # the app's endpoint too
        assert "result" in await rpc.call("subscribe", {"channel": "order:7"})  # signed in: the rule holds
    # with another user's session cookie beside it: bob is read again by his key, never from ann's session
    async with _rpc(host.url("realtime/"), {"Authorization": "Bearer jwt.bob", "Cookie": host.cookie}) as rpc:
        for order in (7, 8):  # two frames: the second reads the user again
            assert "result" in await rpc.call("subscribe", {"channel": f"order:{order}"}), order


async def test_the_apps_endpoint_reads_its_own_tokens_and_refuses_a_foreign_one_clearly(host: Host) -> None:
    async with _rpc(host.url("realtime/"), {"Authorization": f"Bearer {host.token}"}) as rpc:
        assert "result" in await rpc.call("subscribe", {"channel": "order:7"})
    ws = await websockets.connect(
        host.url("realtime/"), additional_headers={"Authorization": "Bearer another-apis-key"}
    )
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4002


async def test_an_order_channel_is_closed_to_those_no_rule_admits(host: Host) -> None:
    async with RPC(host.url("realtime/")) as anonymous:
        answer = await anonymous.call("subscribe", {"channel": "order:7"})
        assert answer["error"]["data"]["reason"] == "forbidden_channel"


def test_a_misspelt_rule_fails_check_is_logged_at_start_and_leaves_the_channel_closed(
    tmp_path: Path, redis_url: str
) -> None:
    env = host_env(tmp_path, redis_url, pattern="ordr:<int:id>")
    checked = manage(env, "check")
    assert checked.returncode != 0 and "realtime_app.E015" in checked.stderr and "'ordr:<int:id>'" in checked.stderr
    assert manage(env, "migrate", "--noinput", "-v", "0").returncode != 0  # Django refuses to run with errors
    subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--skip-checks", "-v", "0"], cwd=ROOT, env=env, check=True
    )
    made = json.loads(manage(env, "shell", "-c", "import json\n" + SETUP).stdout.splitlines()[-1])
    server = Server(env, app="tests.hostproject.asgi:application").start()
    try:

        async def both() -> None:
            for headers in ({}, {"Cookie": made["cookie"]}, {"Authorization": f"Bearer {made['token']}"}):
                async with _rpc(f"ws://127.0.0.1:{server.port}/realtime/", headers) as rpc:
                    answer = await rpc.call("subscribe", {"channel": "order:7"})
                    assert answer["error"]["data"]["reason"] == "forbidden_channel", headers

        asyncio.run(both())
        eventually_sync(
            lambda: (
                "ERROR realtime_app.checks realtime_app.E015: POLICIES[0] pattern 'ordr:<int:id>'" in server.output()
            ),
            what="the log",
        )
    finally:
        server.stop()


class _rpc(RPC):
    """An RPC client with headers of its own (a Bearer, say)."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        super().__init__(url)
        self.headers = dict(headers)


def test_each_channels_redis_host_reads_without_a_timeout_unless_it_says_one() -> None:
    from realtime_app.cluster.layer_timeouts import unbounded_layer_reads

    layers = {
        "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": ["redis://h:6379/0"]}},
        "pubsub": {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": [("h", 6379)]}},
        "bounded": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [{"address": "redis://h", "socket_timeout": 30}, "redis://h/0?socket_timeout=9"]},
        },
        "memory": {"BACKEND": "channels.layers.InMemoryChannelLayer"},
        "bare": {"BACKEND": "channels_redis.core.RedisChannelLayer"},
    }
    assert unbounded_layer_reads(layers) == ["default", "pubsub", "bare"]
    assert layers["default"]["CONFIG"]["hosts"] == [{"address": "redis://h:6379/0", "socket_timeout": None}]
    assert layers["pubsub"]["CONFIG"]["hosts"] == [{"host": "h", "port": 6379, "socket_timeout": None}]
    assert layers["bare"]["CONFIG"]["hosts"] == [{"address": "redis://localhost:6379", "socket_timeout": None}]
    assert layers["bounded"]["CONFIG"]["hosts"][0]["socket_timeout"] == 30 and "CONFIG" not in layers["memory"]
    assert unbounded_layer_reads(layers) == []  # once is enough
