"""docs/deploy/nginx.conf, run as written (ports and paths replaced) in front of two daphne
processes of the demo site with DEBUG off: static files from nginx, the admin, the
WebSocket endpoint through the proxy, and sockets that trickle their headers held by
nginx, never by daphne."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import psutil
import pytest
import redis

from tests.support.servers import ROOT, free_port, login, prepare_database, servers, wait_listening
from tests.support.waiting import eventually
from tests.support.wsclient import RPC

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

CONFIG = ROOT / "docs" / "deploy" / "nginx.conf"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, redis_url):
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if nginx is None:
        pytest.fail("nginx is required (scripts/test installs Debian's nginx-light)")
    url = redis_url  # the conftest fixture: set and answering, or the test fails
    # nginx's workers run as an unprivileged user when the master is root: a directory
    # they can read (pytest's own temporary directories are private)
    root = Path(tempfile.mkdtemp(prefix="realtime-deploy-"))
    root.chmod(0o755)
    static = root / "staticfiles"
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-{secrets.token_hex(3)}"
    env = {
        **prepare_database(str(root / "db.sqlite3")),
        "REDIS_URL": url,
        "REALTIME_KEY_PREFIX": prefix,
        "DJANGO_DEBUG": "0",
        "DJANGO_STATIC_ROOT": str(static),
    }
    collect = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--noinput", "-v", "0"],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env},
        capture_output=True,
        text=True,
    )
    assert collect.returncode == 0, collect.stderr
    with servers(2, env, extra_args=["--proxy-headers"]) as (a, b):
        port = free_port()
        config = CONFIG.read_text()
        for old, new in (
            ("127.0.0.1:8000", f"127.0.0.1:{port}"),
            ("127.0.0.1:8001", f"127.0.0.1:{a.port}"),
            ("127.0.0.1:8002", f"127.0.0.1:{b.port}"),
            ("/srv/mysite/staticfiles/", f"{static}/"),
        ):
            assert old in config, old
            config = config.replace(old, new)
        (root / "nginx" / "tmp").mkdir(parents=True)
        (root / "nginx").chmod(0o755)
        (root / "nginx" / "tmp").chmod(0o777)
        (root / "nginx" / "nginx.conf").write_text(config)
        log = (root / "nginx.log").open("wb")
        proxy = subprocess.Popen(
            [nginx, "-p", str(root / "nginx"), "-c", str(root / "nginx" / "nginx.conf"), "-g", "daemon off;"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_listening(port, proxy, 15, (root / "nginx.log").read_text)
            yield f"http://127.0.0.1:{port}", (a, b)
        finally:
            proxy.terminate()
            proxy.wait(10)
            log.close()
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)
    shutil.rmtree(root, ignore_errors=True)


def fetch(url: str, cookie: str | None = None) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(), dict(error.headers)


def test_static_files_come_from_nginx_and_the_admin_works_through_it(deployment):
    base, _ = deployment
    status, js, headers = fetch(base + "/static/realtime_app/realtime.js")
    assert status == 200 and "export class RealtimeClient" in js
    assert headers.get("Server", "").startswith("nginx") and "Expires" in headers  # not Django (DEBUG is off)
    cookie = login(base, "admin", "admin")
    status, page, _ = fetch(base + "/admin/", cookie)
    assert status == 200 and "Realtime cluster" in page
    status, page, _ = fetch(base + "/admin/realtime_app/realtimecluster/", cookie)
    assert status == 200 and "<code>realtime:socket</code>" in page  # the canonical name of the default cadence


async def test_the_websocket_endpoint_through_the_proxy_reaches_both_processes(deployment):
    base, (a, b) = deployment
    ws = base.replace("http", "ws") + "/realtime/"
    async with RPC(ws) as anonymous:
        assert (await anonymous.call("ping"))["result"] == "pong"
        await anonymous.subscribe("demo:clock:200")
        frames = await anonymous.frames(3)
        assert [f["seq"] for f in frames] == list(range(frames[0]["seq"], frames[0]["seq"] + 3))
    async with RPC(ws, cookie=login(base, "admin", "admin")) as staff:
        await staff.subscribe("realtime:socket:500")

        async def both_seen() -> bool:  # the cluster view, as it streams to a staff socket
            return {p["pid"] for p in (await staff.frames(1))[0]["data"]["instances"]} == {a.process.pid, b.process.pid}

        await eventually(both_seen, 15, "both processes in the cluster view")


async def test_a_client_sent_forwarded_header_through_nginx_changes_nothing(deployment):
    """Found: nginx passed a client's own ``Forwarded`` untouched and the app preferred it
    to the X-Forwarded-For nginx wrote: any client could name its address. The app reads
    only the configured header, and the documented config clears ``Forwarded``."""
    base, _ = deployment
    ws = base.replace("http", "ws") + "/realtime/"
    liar = RPC(ws)
    liar.headers["Forwarded"] = "for=203.0.113.66"
    liar.headers["X-Real-IP"] = "203.0.113.67"
    async with liar:
        assert (await liar.call("ping"))["result"] == "pong"
        cookie = login(base, "admin", "admin")

        def addresses() -> set[str]:
            status, body, _ = fetch(base + "/realtime/api/health", cookie)
            assert status == 200, body
            return {c.get("address") for p in json.loads(body)["instances"] for c in p.get("top_connections", [])}

        seen = await eventually(lambda: addresses() or None, 15, "the connection in the probe")
    assert seen and not seen & {"203.0.113.66", "203.0.113.67"}, seen


async def test_sockets_trickling_headers_are_held_by_nginx_not_daphne(deployment):
    base, (a, b) = deployment
    port = int(base.rsplit(":", 1)[1])

    def daphne_sockets() -> int:
        return sum(len(psutil.Process(s.process.pid).net_connections(kind="tcp")) for s in (a, b))

    before = daphne_sockets()
    slow = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /realtime/ HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the end of the headers
        slow.append(s)

    def accepted_by_nginx() -> int:  # taken off the listen queue by a process: nginx's workers
        return sum(
            1
            for c in psutil.net_connections(kind="tcp")
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED and c.pid is not None
        )

    try:
        await eventually(lambda: accepted_by_nginx() >= 200, 15, "nginx accepting the 200 sockets")
        assert daphne_sockets() <= before + 5  # nginx holds them (and cuts them after 10 s)
        async with RPC(base.replace("http", "ws") + "/realtime/") as rpc:  # everyone else is served
            assert (await rpc.call("ping"))["result"] == "pong"
    finally:
        for s in slow:
            s.close()


def test_the_config_is_the_documented_one():
    assert "docs/deploy/nginx.conf" in (ROOT / "docs" / "deployment.md").read_text()
    assert Path(CONFIG).exists()
