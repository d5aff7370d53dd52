"""The probes from outside: health JSON and metrics access, the health channel, the
realtime_probe command and the admin's live cluster screen in headless chromium."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import redis

from tests.servers import ROOT, login, prepare_database, servers
from tests.support.waiting import eventually
from tests.wsclient import RPC

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, redis_url):
    url = redis_url  # the conftest fixture: set and answering, or the test fails
    database = prepare_database(str(tmp_path_factory.mktemp("db") / "db.sqlite3"))
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-{secrets.token_hex(3)}"
    env = {**database, "REDIS_URL": url, "REALTIME_KEY_PREFIX": prefix, "REALTIME_METRICS_TOKEN": "s3cret"}
    with servers(2, env) as procs:
        yield procs, env
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"{prefix}*"):
        client.delete(key)


def get(url, cookie=None, headers=None):
    request = urllib.request.Request(url, headers={**({"Cookie": cookie} if cookie else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_health_and_metrics_are_for_staff(cluster):
    (a, _), _ = cluster
    staff, user = login(a.http, "admin", "admin"), login(a.http, "demo", "demo")
    for path in ("/realtime/api/health", "/realtime/metrics"):
        assert get(a.http + path)[0] == 401
        assert get(a.http + path, user)[0] == 403
        assert get(a.http + path, staff)[0] == 200
    status, body = get(a.http + "/realtime/api/health", staff)
    probe = json.loads(body)
    assert probe["clustered"] and {"instances", "totals", "generated_at"} <= set(probe)
    instance = probe["instances"][0]
    assert {"instance", "host", "pid", "uptime_s", "connections", "subscriptions", "channels", "tickers"} <= set(
        instance
    )
    assert set(instance["backpressure"]) == {
        "max_buffered_amount",
        "max_drop_balance",
        "total_buffered_amount",
        "slow_consumers",
        "drops",
        "closes",
    }
    assert {"pending", "queued", "running", "admitted", "coalesced", "refused", "identities", "bucket"} <= set(
        instance["admission"]
    )
    assert instance["admission"]["bucket"] == "shared"  # on Redis: users' buckets are the cluster's
    assert set(instance["history"]) == {"channels", "recoveries", "replayed", "gaps"}
    assert set(instance["history"]["recoveries"]) == {"served", "failed", "deferred"}
    status, text = get(a.http + "/realtime/metrics", headers={"Authorization": "Bearer s3cret"})
    assert status == 200 and "realtime_backpressure_drops_total" in text and "realtime_connections{" in text
    for metric in ("running{", "admitted_total{", "shared_bucket{"):
        assert f"realtime_admission_{metric}" in text
    assert "realtime_admission_refused_total{" in text and 'reason="rate_limited"' in text
    assert "realtime_history_replayed_total{" in text and "realtime_history_recoveries_total{" in text
    assert get(a.http + "/realtime/metrics", headers={"Authorization": "Bearer wrong"})[0] == 401


async def test_health_channel_is_staff_only_and_lists_both_processes(cluster):
    (a, b), _ = cluster
    async with RPC(a.ws) as anon:
        error = (await anon.call("subscribe", {"channel": "realtime:socket:1000"}))["error"]
        assert error["data"]["reason"] == "forbidden_channel"
    async with RPC(b.ws) as other, RPC(a.ws, cookie=login(a.http, "admin", "admin")) as staff:
        result = await staff.subscribe("realtime:socket:500")
        assert result == {"channel": "realtime:socket:500", "kind": "state", "interval_ms": 500}

        async def both_listed() -> dict | None:
            frame = (await staff.frames(1))[0]
            return frame if {p["pid"] for p in frame["data"]["instances"]} == {a.process.pid, b.process.pid} else None

        frame = await eventually(both_listed, 15, "both processes listed")
        assert frame["data"]["totals"]["connections"] >= 2
        del other


async def test_realtime_probe_command(cluster):
    (a, b), env = cluster
    run_env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env}

    def probe_command(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "manage.py", "realtime_probe", *args],
            cwd=ROOT,
            env=run_env,
            capture_output=True,
            text=True,
        )

    for server in (a, b):  # a process joins the cluster view with its first request
        assert get(server.http + "/accounts/login/")[0] == 200

    async def both_listed() -> bool:
        result = await asyncio.to_thread(probe_command, "--json")
        return {p["pid"] for p in json.loads(result.stdout)["instances"]} == {a.process.pid, b.process.pid}

    await eventually(both_listed, 15, "both processes in realtime_probe --json")
    table = await asyncio.to_thread(probe_command)
    assert table.returncode == 0 and "worst queue" in table.stdout and "rpc run/wait" in table.stdout
    assert "http pools run/wait (503)" in table.stdout and "unsaved (oldest)" in table.stdout
    assert "heavy 0/0 (0)" in table.stdout
    assert "resumes ok/lost (replayed)" in table.stdout and "0/0 (0)" in table.stdout
    assert str(a.process.pid) in table.stdout and str(b.process.pid) in table.stdout
    bad = await asyncio.to_thread(probe_command, "--watch", "0")
    assert bad.returncode != 0 and "positive" in bad.stderr


@pytest.mark.browser
def test_admin_cluster_screen_is_live(cluster, tmp_path):
    from selenium.webdriver.common.by import By

    from tests.browser import chromium, log_in, wait

    (a, b), _ = cluster
    assert get(b.http + "/accounts/login/")[0] == 200  # b joins the cluster view with its first request
    browser = chromium()
    try:
        log_in(browser, a.http, "admin", "admin")
        browser.get(f"{a.http}/admin/")
        links = wait(browser).until(lambda b: b.find_elements(By.LINK_TEXT, "Realtime cluster"))
        links[0].click()

        def rows(_):
            found = browser.find_elements(By.CSS_SELECTOR, "#rc-rows tr[data-instance]")
            return found if len(found) == 2 else False

        found = wait(browser).until(rows)
        marker = browser.execute_script("window.__noReload = true; return 1")
        assert marker == 1
        text_before = {r.get_attribute("data-instance"): r.text for r in found}
        assert all(str(pid) in " ".join(text_before.values()) for pid in (a.process.pid, b.process.pid))
        updated = browser.find_element(By.ID, "rc-updated").text
        wait(browser).until(lambda _: browser.find_element(By.ID, "rc-updated").text != updated)
        # uptimes move on: the numbers change without a reload
        wait(browser).until(
            lambda _: {r.get_attribute("data-instance"): r.text for r in rows(None) or []} != text_before
        )
        assert browser.execute_script("return window.__noReload === true")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#rc-chart polyline")) == 2
        heads = [
            th.get_attribute("textContent")
            for th in browser.find_elements(By.XPATH, "//tbody[@id='rc-rows']/../thead//th")
        ]
        assert "requests running / waiting" in heads and "refused" in heads and "user buckets" in heads
        assert "HTTP pools" in heads and "unsaved (write-behind)" in heads
        wait(browser).until(lambda _: (found := rows(None)) and all("shared" in r.text for r in found))
        browser.save_screenshot(str(tmp_path / "admin-cluster.png"))
    finally:
        browser.quit()
