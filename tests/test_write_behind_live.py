"""Write-behind on real daphne processes and a real PostgreSQL: the demo inventory of one
user on two processes, SIGTERM during a burst, kill -9, the database cut for seconds."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any
from urllib.parse import urlparse

import psycopg
import pytest
import websockets

from tests.support.postgres import TcpProxy, with_port
from tests.support.servers import ROOT, Server, login, servers
from tests.support.waiting import eventually
from tests.support.wsclient import RPC

pytestmark = pytest.mark.timeout(180)
START = 10_000


def env_for(database_url: str, delay_ms: int, journal: str | None = None, **extra: str) -> dict[str, str]:
    overrides: dict[str, Any] = {"WRITE_BEHIND_DELAY_MS": delay_ms}
    if journal is not None:
        overrides["WRITE_BEHIND_JOURNAL_DIR"] = journal
    return {"DATABASE_URL": database_url, "REDIS_URL": "", "REALTIME_TEST_OVERRIDES": json.dumps(overrides), **extra}


def durable_shots(database_url: str) -> int | None:
    with psycopg.connect(database_url.replace("postgres://", "postgresql://", 1)) as conn:
        row = conn.execute(
            "SELECT shots FROM demo_inventoryitem i JOIN auth_user u ON u.id = i.user_id "
            "WHERE u.username = 'demo' AND i.item = 'ammo'"
        ).fetchone()
    return None if row is None else int(row[0])


def reset(database_url: str) -> None:
    with psycopg.connect(database_url.replace("postgres://", "postgresql://", 1)) as conn:
        conn.execute("DELETE FROM demo_inventoryitem")


async def fire(rpc: RPC, n: int, shots: int = 1) -> list[dict[str, Any]]:
    """``n`` consumes, one after the other (each answered before the next: none refused
    for being in flight); returns the accepted answers."""
    accepted = []
    for _ in range(n):
        answer = await rpc.call("inventory.consume", {"item": "ammo", "shots": shots})
        if "result" in answer:
            accepted.append(answer["result"])
        else:
            assert answer["error"]["data"]["reason"] == "rate_limited", answer
            await asyncio.sleep(answer["error"]["data"]["retry_after_ms"] / 1000)
    return accepted


async def test_one_user_on_two_processes_both_land_exactly(postgres):
    _, database = postgres
    reset(database)
    with servers(2, env_for(database, 300)) as (a, b):
        cookie = login(a.http, "demo", "demo")
        async with RPC(a.ws, cookie=cookie) as on_a, RPC(b.ws, cookie=cookie) as on_b:
            got_a, got_b = await asyncio.gather(fire(on_a, 40, 3), fire(on_b, 40, 2))
            total = sum(r["shots"] for r in got_a + got_b)
            assert total == 40 * 3 + 40 * 2
            await eventually(lambda: durable_shots(database) == START - total, 20, "both processes' shots durable")
            snapshot = (await on_a.call("inventory.snapshot"))["result"]
        # each process flushed its own deltas: the sum is exact, nothing overwritten
        assert durable_shots(database) == START - 200
        assert snapshot["durable"]["ammo"] <= START - 120  # a read back its own and maybe b's


async def test_a_process_that_writes_nothing_sees_the_others_counters_within_the_delay_plus_a_flush(postgres):
    """Found: on two processes, b reported 97 for more than 30 s while the table held 130;
    a flush of b that wrote nothing did not read the counter back, only a shot of its own
    did. Now each process reads the counters it holds back every delay."""
    _, database = postgres
    reset(database)
    delay_ms = 500
    with servers(2, env_for(database, delay_ms)) as (a, b):
        cookie = login(a.http, "demo", "demo")
        async with RPC(a.ws, cookie=cookie) as on_a, RPC(b.ws, cookie=cookie) as on_b:
            await fire(on_b, 1)  # b holds the inventory from now on
            await eventually(lambda: durable_shots(database) == START - 1, 20, "b's shot durable")
            await fire(on_a, 30)  # and b fires nothing more
            await eventually(lambda: durable_shots(database) == START - 31, 20, "a's shots durable")
            durable_at = time.monotonic()

            async def b_sees_the_table() -> bool:
                answer = await on_b.call("inventory.snapshot")
                if answer.get("result", {}).get("items", {}).get("ammo") == START - 31:
                    return True
                await asyncio.sleep(0.2)  # within b's bucket: a snapshot costs 0.25
                return False

            await eventually(b_sees_the_table, 10 * delay_ms / 1000 + 10, "b's view of the counter")
            print(f"b caught up {time.monotonic() - durable_at:.2f} s after a's shots were durable")
            assert (await on_b.call("inventory.snapshot"))["result"]["durable"]["ammo"] == START - 31


async def test_sigterm_during_a_burst_flushes_everything_accepted(postgres):
    _, database = postgres
    reset(database)
    server = Server(env_for(database, 60_000)).start()  # nothing would be written for a minute
    try:
        cookie = login(server.http, "demo", "demo")
        accepted: list[dict[str, Any]] = []

        async def burst() -> None:
            async with RPC(server.ws, cookie=cookie) as rpc:
                try:
                    while True:
                        accepted.extend(await fire(rpc, 1, 5))
                except (websockets.ConnectionClosed, ConnectionError):
                    return  # the server went away (a wrong answer fails the test, above all)

        task = asyncio.get_running_loop().create_task(burst())
        await eventually(lambda: len(accepted) >= 20, 20, "shots accepted")
        assert durable_shots(database) is None  # nothing durable yet
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(30)
        await task
        # every accepted shot is durable; one more may be too (applied, its answer lost with the close)
        durable = durable_shots(database)
        assert durable is not None and START - 5 * (len(accepted) + 1) <= durable <= START - 5 * len(accepted)
        assert "Traceback" not in server.output()
    finally:
        server.stop()


#: What a process killed without warning may lose beyond ``WRITE_BEHIND_DELAY_MS``: the
#: flush that was running (a few milliseconds of PostgreSQL here) and the event loop
#: turning late on a busy machine.
FLUSH_SLACK_S = 0.75


@pytest.mark.parametrize("delay_ms", [500, 1000, 2000])
async def test_kill_9_loses_at_most_the_delay_plus_one_flush(postgres, delay_ms):
    """docs/write-behind.md: a crash loses at most the changes of the last delay plus the
    flush that was running. Shots are accepted one after the other while the table is
    read, for three whole flush cycles: at no moment is the newest durable shot older than
    ``delay + FLUSH_SLACK_S`` (what a crash then would lose); then the process is killed,
    and the same holds of what it lost, counted in shots."""
    _, database = postgres
    reset(database)
    server = Server(env_for(database, delay_ms)).start()
    bound = delay_ms / 1000 + FLUSH_SLACK_S

    def accepted_at(durable: int) -> float:
        """When the newest durable state was accepted (its answer's arrival)."""
        return next(t for t, left in reversed(history) if left >= durable)

    try:
        cookie = login(server.http, "demo", "demo")
        history: list[tuple[float, int]] = []  # (when its answer came, shots left)
        stalest = 0.0  # the oldest the newest durable shot ever was, read as it ran
        seen: list[int] = []  # each durable value as it changed: one per flush
        async with RPC(server.ws, cookie=cookie) as rpc:
            assert server.process is not None
            deadline = time.monotonic() + 10 * delay_ms / 1000 + 10
            while len(seen) < 4:  # three whole flush cycles after the first flush
                assert time.monotonic() < deadline, f"flushes seen: {len(seen)}"
                for result in await fire(rpc, 1):
                    history.append((time.monotonic(), result["shots_left"]))
                durable = durable_shots(database)
                if durable is not None and durable < START:
                    stalest = max(stalest, time.monotonic() - accepted_at(durable))
                    if not seen or seen[-1] != durable:
                        seen.append(durable)
                await asyncio.sleep(0.02)
            server.process.kill()
            killed_at = time.monotonic()
            server.process.wait(10)
        durable = durable_shots(database)
        assert durable is not None  # flushes happened before the crash
        lost_window = killed_at - accepted_at(durable)
        lost = durable - history[-1][1]
        in_bound = sum(1 for t, _ in history if t > killed_at - bound)
        print(
            f"kill -9 at {delay_ms} ms: newest durable shot {lost_window:.2f} s old at the kill, "
            f"{stalest:.2f} s at most while running; {lost} of {len(history)} shots lost"
        )
        assert stalest <= bound, (stalest, bound)
        assert lost_window <= bound and lost <= in_bound, (lost_window, lost, in_bound)
    finally:
        server.stop()


async def test_the_database_cut_for_seconds_loses_nothing(postgres):
    server_url, database = postgres
    reset(database)
    proxy = TcpProxy(urlparse(server_url).port or 5432)
    server = Server(env_for(with_port(database, proxy.port), 300, REALTIME_METRICS_TOKEN="s3cret"))
    try:
        proxy.restore()
        server.start()
        cookie = login(server.http, "demo", "demo")
        async with RPC(server.ws, cookie=cookie) as rpc:
            before = await fire(rpc, 10)
            await eventually(lambda: durable_shots(database) == START - 10, 15, "the first shots durable")
            proxy.cut()
            during = await fire(rpc, 15)  # accepted in memory while the database is gone
            assert len(during) == 15

            def failures() -> int:
                """From Prometheus with the bearer token: the metrics need no database."""
                import urllib.request

                request = urllib.request.Request(
                    server.http + "/realtime/metrics", headers={"Authorization": "Bearer s3cret"}
                )
                text = urllib.request.urlopen(request, timeout=10).read().decode()
                line = next(
                    line
                    for line in text.splitlines()
                    if line.startswith("realtime_write_behind_consecutive_failures{") and "demo.inventory" in line
                )
                return int(float(line.rsplit(" ", 1)[1]))

            await eventually(lambda: failures() >= 1, 20, "the flush fails and says so")
            proxy_cut_probe = failures()
            await asyncio.sleep(2)
            proxy.restore()
            await eventually(lambda: durable_shots(database) == START - 25, 60, "every shot durable after the outage")
            await eventually(lambda: failures() == 0, 30, "the store recovered")
        assert len(before) == 10 and proxy_cut_probe >= 1
        assert "Traceback" not in server.output()
    finally:
        server.stop()
        proxy.cut()


async def test_sigterm_during_a_database_outage_loses_nothing_and_the_next_start_writes_it(postgres, tmp_path):
    """Found: the database cut, SIGTERM 10 s later: every shot that process accepted during
    the outage was lost, the log saying one WARNING then `exit: 0 object(s) flushed`."""
    server_url, database = postgres
    reset(database)
    proxy = TcpProxy(urlparse(server_url).port or 5432)
    journal = tmp_path / "journal"
    env = env_for(with_port(database, proxy.port), 300, journal=str(journal))
    first = Server(env)
    try:
        proxy.restore()
        first.start()
        cookie = login(first.http, "demo", "demo")
        async with RPC(first.ws, cookie=cookie) as rpc:
            before = await fire(rpc, 10)
            await eventually(lambda: durable_shots(database) == START - 10, 15, "the first shots durable")
            proxy.cut()
            during = await fire(rpc, 30)  # acknowledged while the database is gone
            await eventually(lambda: "flush of" in first.output(), 20, "the flush failing")
        assert len(before) == 10 and len(during) == 30
        assert first.process is not None
        first.process.send_signal(signal.SIGTERM)
        first.process.wait(60)
        assert durable_shots(database) == START - 10  # nothing more reached the database
        assert list(journal.glob("*.json")), "a journal file"
        assert "kept in" in first.output() and "LOST" not in first.output()
    finally:
        first.stop()
    proxy.restore()
    second = Server(env)
    try:
        second.start()
        async with RPC(second.ws) as rpc:  # a first connection starts the hub, which takes the journal over
            assert (await rpc.call("ping"))["result"] == "pong"
        await eventually(lambda: durable_shots(database) == START - 40, 60, "the journaled shots durable")
        await eventually(lambda: not list(journal.iterdir()), 20, "the journal file gone once written")
        assert durable_shots(database) == START - 40  # none applied twice
        assert "Traceback" not in second.output()
    finally:
        second.stop()
        proxy.cut()


def test_a_management_command_flushes_what_it_accepted_when_it_ends(postgres):
    import os
    import subprocess
    import sys

    from tests.support.servers import ROOT

    _, database = postgres
    reset(database)
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env_for(database, 60_000)}
    done = subprocess.run(
        [sys.executable, "manage.py", "demo_fire", "demo", "7"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "7 shots accepted, 9993 left" in done.stdout
    assert durable_shots(database) == START - 7  # written at exit, not 60 s later


@pytest.mark.browser
async def test_the_admin_screen_shows_an_unsaved_backlog_at_a_glance(postgres):
    from selenium.webdriver.common.by import By

    from tests.support.browser import chromium, log_in, wait

    server_url, database = postgres
    reset(database)
    proxy = TcpProxy(urlparse(server_url).port or 5432)
    server = Server(env_for(with_port(database, proxy.port), 500))
    browser = None
    try:
        proxy.restore()
        server.start()
        browser = chromium()
        cookie = login(server.http, "demo", "demo")
        await asyncio.to_thread(log_in, browser, server.http, "admin", "admin")
        await asyncio.to_thread(browser.get, f"{server.http}/admin/realtime_app/realtimecluster/")

        def backlog(_: Any) -> Any:  # the process's card: degraded, saying why
            return browser.find_elements(By.CSS_SELECTOR, "#rc-cards [data-state=degraded] .why")

        async with RPC(server.ws, cookie=cookie) as rpc:
            await fire(rpc, 5)
            await eventually(lambda: durable_shots(database) == START - 5, 15, "saved")
            assert not backlog(None)
            proxy.cut()
            await fire(rpc, 5)  # accepted; the flushes fail
            await asyncio.to_thread(
                wait(browser, 30).until, lambda b: any("demo.inventory" in e.text for e in backlog(b))
            )
            proxy.restore()
            await asyncio.to_thread(wait(browser, 60).until, lambda b: not backlog(b))
        assert durable_shots(database) == START - 10
    finally:
        if browser is not None:
            browser.quit()
        server.stop()
        proxy.cut()


async def test_uvicorn_flushes_at_lifespan_shutdown(postgres):
    _, database = postgres
    reset(database)
    server = Server(env_for(database, 60_000), server="uvicorn", extra_args=["--lifespan", "on"]).start()
    try:
        cookie = login(server.http, "demo", "demo")
        async with RPC(server.ws, cookie=cookie) as rpc:
            accepted = await fire(rpc, 12)
        assert durable_shots(database) is None
        assert server.process is not None
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(30)
        assert durable_shots(database) == START - len(accepted)
        assert "shutdown: 1 object(s) flushed" in server.output()  # by the lifespan, not at exit
    finally:
        server.stop()


def test_the_write_behind_unit_tests_hold_on_postgresql(postgres):
    """tests/test_write_behind.py (flush marks, lost commits, cancelled writes, integrity
    errors, statement counts) and tests/test_write_behind_models.py (a model with a required
    field, journals, convergence) once more with PostgreSQL as Django's database."""
    server, _ = postgres
    name = f"{os.environ['REALTIME_TEST_PREFIX'].replace('-', '_')}_units"
    env = {k: v for k, v in os.environ.items() if k != "REALTIME_TEST_DB_FILE"}
    env.update(
        DATABASE_URL=f"{server.rsplit('/', 1)[0]}/{name}",
        REALTIME_TEST_DB_VENDOR="postgresql",
        DJANGO_SETTINGS_MODULE="tests.settings",
    )
    modules = ["tests/test_write_behind.py", "tests/test_write_behind_models.py"]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *modules]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert re.fullmatch(r"=*\s*50 passed in [\d.]+s.*", summary), summary
