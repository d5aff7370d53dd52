"""The demo dashboard in headless chromium against a real daphne: live values, the
adaptive badge under a slow network, make-before-break, reconnects and close codes."""

from __future__ import annotations

import pytest
from selenium.webdriver.common.by import By

from tests.support.browser import chromium, log_in, wait
from tests.support.servers import Server

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]


@pytest.fixture
def site(database):
    server = Server({**database, "REDIS_URL": ""}).start()
    yield server
    server.stop()


@pytest.fixture
def browser():
    b = chromium()
    yield b
    b.quit()


def text(browser, css):
    return browser.find_element(By.CSS_SELECTOR, css).text


def test_anonymous_dashboard_is_live(site, browser):
    browser.get(site.http + "/")
    wait(browser, 15).until(lambda b: text(b, "#state") == "open")
    first = wait(browser, 10).until(
        lambda b: text(b, "#row-clock .seq") not in ("", "–") and text(b, "#row-clock .seq")
    )
    wait(browser, 5).until(lambda b: text(b, "#row-clock .seq") != first)
    assert "log in" in text(browser, "#row-load .value")


def test_slow_network_backs_the_cadence_off_and_it_recovers(site, browser):
    log_in(browser, site.http, "demo", "demo")
    browser.get(site.http + "/")
    wait(browser, 15).until(lambda b: text(b, "#row-load .seq") not in ("", "–"))
    assert text(browser, "#load-cadence") == "1000 ms"
    browser.find_element(By.ID, "slow-network").click()
    wait(browser, 20).until(lambda b: text(b, "#load-cadence") == "2000 ms")
    browser.find_element(By.ID, "slow-network").click()
    wait(browser, 30).until(lambda b: text(b, "#load-cadence") == "1000 ms")
    recovered_at = browser.execute_script("return performance.now()")
    wait(browser, 10).until(
        lambda b: (
            b.execute_script("return window.realtime.frames.filter(f => f[0] > arguments[0]).length", recovered_at) >= 3
        )
    )
    frames = browser.execute_script("return window.realtime.frames")
    # make-before-break: around the switch back from 2000 ms, the stream has no hole
    # longer than twice the old cadence
    switch = next(i for i, f in enumerate(frames) if f[1] == "atelier:load" and i > 0 and frames[i - 1][1] != f[1])
    window = frames[max(0, switch - 3) : switch + 3]
    gaps = [b[0] - a[0] for a, b in zip(window, window[1:], strict=False)]
    assert max(gaps) <= 2 * 2000, gaps
    assert browser.execute_script("return window.realtime.load.intervalMs") == 1000


def test_reconnects_and_resubscribes_after_a_server_restart(site, browser, database):
    browser.get(site.http + "/")
    wait(browser, 15).until(lambda b: text(b, "#row-clock .seq") not in ("", "–"))
    site.stop()
    wait(browser, 15).until(lambda b: text(b, "#state") == "reconnecting")
    restarted = Server({**database, "REDIS_URL": ""}, port=site.port).start()
    try:
        wait(browser, 40).until(lambda b: text(b, "#state") == "open")
        before = text(browser, "#row-clock .seq")
        wait(browser, 10).until(lambda b: text(b, "#row-clock .seq") != before)  # resubscribed by itself
    finally:
        restarted.stop()


@pytest.mark.parametrize(("code", "reconnects"), [(1013, True), (1008, False)])
def test_close_codes(site, browser, code, reconnects):
    browser.get(site.http + "/")
    wait(browser, 15).until(lambda b: text(b, "#state") == "open")
    browser.execute_script(
        "window.closes = []; window.realtime.client.addEventListener('close', e => window.closes.push(e.detail));"
        "window.realtime.client.notify('test.close', {code: arguments[0]});",
        code,
    )
    wait(browser, 10).until(lambda b: b.execute_script("return window.closes.length") >= 1)
    detail = browser.execute_script("return window.closes[0]")
    assert (detail["code"], detail["willReconnect"]) == (code, reconnects)
    if reconnects:
        wait(browser, 15).until(lambda b: text(b, "#state") == "open")
    else:
        # Stopped for good at the close itself: no reconnect timer was ever set (the one
        # way a reconnect could still come), and the socket is gone.
        c = browser.execute_script("const c = window.realtime.client; return [c._stopped, c._timer, c._ws, c.state]")
        assert c == [True, None, None, "closed"], c
        assert browser.execute_script("return window.closes.length") == 1


def test_the_burst_panel_shows_admitted_merged_and_refused_with_the_snapshot_applied(site, browser):
    browser.get(site.http + "/")
    wait(browser, 15).until(lambda b: text(b, "#inventory") == "ammo: 10000")
    browser.find_element(By.ID, "burst").click()
    wait(browser, 15).until(
        lambda b: (
            text(b, "#burst-sent") == "60" and int(text(b, "#burst-admitted")) + int(text(b, "#burst-refused")) == 60
        )
    )
    admitted, merged, refused = (int(text(browser, f"#burst-{k}")) for k in ("admitted", "merged", "refused"))
    print(f"burst: {admitted} admitted, {merged} merged, {refused} refused")
    assert 10 <= admitted < 60  # 10 in flight per player; more only as answers come back
    # One operation at a time per inventory: the shots fired while the first ran waited and
    # merged into the next; the first ran alone.
    assert 1 <= merged <= admitted - 1, (admitted, merged)
    assert "too_many_in_flight" in text(browser, "#burst-reasons")  # 10 in flight per identity
    burst = browser.execute_script("return window.realtime.burst")
    assert sum(burst["reasons"].values()) == refused
    # Every answer and every refusal's snapshot left the badge on the true inventory.
    wait(browser, 10).until(lambda b: text(b, "#inventory") == f"ammo: {10000 - 5 * admitted}")


def test_the_inventory_shows_accepted_at_once_and_durable_after_the_flush(site, browser):
    log_in(browser, site.http, "demo", "demo")
    browser.get(site.http + "/")
    wait(browser, 15).until(lambda b: text(b, "#inventory").startswith("ammo: "))
    before = int(text(browser, "#inventory").split(": ")[1])
    browser.find_element(By.ID, "burst").click()
    wait(browser, 15).until(lambda b: int(text(b, "#burst-admitted")) + int(text(b, "#burst-refused")) == 60)
    accepted = before - 5 * int(text(browser, "#burst-admitted"))
    wait(browser, 10).until(lambda b: text(b, "#inventory") == f"ammo: {accepted}")  # accepted at once
    wait(browser, 5).until(lambda b: "saving…" in text(b, "#durable"))  # not durable yet (a 5 s delay)
    wait(browser, 20).until(lambda b: "saved ✓" in text(b, "#durable"))
    assert f"durable: ammo: {accepted}" in text(browser, "#durable")


def test_the_events_missed_while_offline_are_recovered_once_in_order(site, browser):
    import asyncio

    from tests.support.wsclient import RPC

    async def publish(texts):
        async with RPC(site.ws) as rpc:
            for t in texts:
                assert "result" in await rpc.call("publish", {"channel": "demo:events", "data": {"text": t}})

    browser.get(site.http + "/")
    wait(browser, 15).until(lambda b: text(b, "#state") == "open")
    asyncio.run(publish(["before"]))
    wait(browser, 10).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#events li")) == 1)
    browser.find_element(By.ID, "offline").click()
    wait(browser, 5).until(lambda b: text(b, "#state") == "reconnecting")
    asyncio.run(publish([f"missed {i}" for i in range(12)]))
    wait(browser, 20).until(lambda b: text(b, "#events-resume") == "recovered 12 missed events")
    items = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#events li")]
    assert len(items) == 13  # newest first, each once
    assert [item.split(" ", 1)[1] for item in reversed(items)] == [
        '{"text":"before"}',
        *[f'{{"text":"missed {i}"}}' for i in range(12)],
    ]
    seqs = [int(item.split(" ", 1)[0][1:]) for item in reversed(items)]
    assert seqs == list(range(seqs[0], seqs[0] + 13))


def test_the_screenshots_script_takes_the_pages_as_they_are(tmp_path):
    """README.md and docs/ show what scripts/screenshots.py takes from the running demo."""
    import struct
    import subprocess
    import sys

    from tests.support.servers import ROOT

    result = subprocess.run(
        [sys.executable, "scripts/screenshots.py", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for name in ("dashboard.png", "admin-cluster.png"):
        header = (tmp_path / name).read_bytes()[:24]
        width, height = struct.unpack(">II", header[16:24])
        assert header.startswith(b"\x89PNG") and width == 1280 and height >= 600, (name, width, height)


def test_a_delta_subscription_in_chromium_rebuilds_what_a_plain_one_gets(site, browser):
    """The browser module with deltas on a live daphne: the data its handler gets is, seq
    by seq, what a plain subscription of the same page gets, across a reconnect."""
    browser.get(site.http + "/")
    wait(browser, 15).until(lambda b: text(b, "#state") == "open")
    browser.execute_script(
        """
        window.deltaTest = {plain: {}, delta: {}, kinds: [], ready: false};
        import("/static/realtime_app/realtime.js").then(async (m) => {
          const channel = "test:state-dropped";  // 2 KB, one field changing per publication
          const plain = new m.RealtimeClient(), withDeltas = new m.RealtimeClient();
          plain.connect(); withDeltas.connect();
          await plain.subscribe(channel, (p) => { window.deltaTest.plain[p.seq] = JSON.stringify(p.data); });
          await withDeltas.subscribe(channel, (p) => {
            window.deltaTest.delta[p.seq] = JSON.stringify(p.data);
            window.deltaTest.kinds.push(p.delta);
          }, {delta: "fossil"});
          Object.assign(window.deltaTest, {withDeltas, plainClient: plain, ready: true});
        });
        """
    )
    wait(browser, 15).until(lambda b: b.execute_script("return window.deltaTest.ready"))
    burst = (
        "return window.deltaTest.plainClient.call('test.publish_burst',"
        " {channels: ['test:state-dropped'], count: 10, size: 2000})"
    )
    count = "return Object.keys(window.deltaTest.delta).length"
    browser.execute_script(burst)
    wait(browser, 30).until(lambda b: b.execute_script(count) >= 10)
    browser.execute_script("window.deltaTest.withDeltas.reconnect(200)")
    wait(browser, 30).until(lambda b: b.execute_script("return window.deltaTest.withDeltas.state") == "open")
    wait(browser, 30).until(lambda b: b.execute_script("return window.deltaTest.withDeltas._answers.size") == 1)
    browser.execute_script(burst)
    wait(browser, 30).until(lambda b: b.execute_script(count) >= 20)
    result = browser.execute_script("return window.deltaTest")
    assert result["delta"] == result["plain"]  # every publication, exactly
    # a full frame first; after the reconnect the current value, whole, at once, and the base
    # of the next delta: 21 frames for 20 publications
    assert result["kinds"].count(False) == 2 and result["kinds"].count(True) == 19


@pytest.fixture
def flooded(database):
    """A site with the flood channel and a small backpressure threshold: a page that stops
    reading has frames dropped within seconds."""
    server = Server(
        {
            **database,
            "REDIS_URL": "",
            "REALTIME_DEMO_FLOOD": "1",
            "REALTIME_MAX_BACKPRESSURE": str(128 * 1024),
            "REALTIME_CLOSE_AFTER_DROPS": "100000",
        }
    ).start()
    yield server
    server.stop()


def test_a_delta_subscription_in_chromium_rebuilds_every_publication_across_drops_and_a_resume(flooded, browser):
    """The browser module with deltas, on a page whose handlers hold its main thread (so
    that it stops reading its socket and the server drops), then on a channel with history
    across a reconnect: each frame its handler gets is, seq by seq, the publication."""
    import asyncio
    import json

    from tests.support.wsclient import RPC

    async def reference(channel, until_seq, publish):
        """What a plain subscriber reads of ``channel``, as JSON text per seq."""
        frames: dict[int, str] = {}
        async with RPC(flooded.ws) as plain, RPC(flooded.ws) as publisher:
            await plain.subscribe(channel)
            await publish(publisher)
            while not frames or max(frames) < until_seq:
                [frame] = await plain.frames(1, timeout=30)
                frames[frame["seq"]] = json.dumps(frame["data"], separators=(",", ":"))
        return frames

    browser.get(flooded.http + "/")
    wait(browser, 15).until(lambda b: text(b, "#state") == "open")
    browser.execute_script(
        """
        window.dt = {got: {}, kinds: {}, plain: {}, slow: true, recovered: 0, ready: false};
        import("/static/realtime_app/realtime.js").then(async (m) => {
          const client = new m.RealtimeClient(), plain = new m.RealtimeClient();
          client.addEventListener("recovered", (e) => { window.dt.recovered += e.detail.replayed; });
          client.connect(); plain.connect();
          await plain.subscribe("test:drift", (p) => { window.dt.plain[p.seq] = JSON.stringify(p.data); });
          const take = (p) => {
            if (p.channel === "test:drift" || p.channel === "test:big-history") {
              window.dt.got[p.channel + " " + p.seq] = JSON.stringify(p.data);
              window.dt.kinds[p.channel + " " + p.seq] = p.delta;
            }
            const until = performance.now() + (window.dt.slow ? 50 : 0);  // the main thread held
            while (performance.now() < until) {}
          };
          await client.subscribe("test:drift", take, {delta: "fossil"});
          await client.subscribe("demo:flood:10", take);  // 32 KiB, 100 a second: the queue fills
          Object.assign(window.dt, {client, take, ready: true});
        });
        """
    )
    wait(browser, 15).until(lambda b: b.execute_script("return window.dt.ready"))

    def seqs(channel):
        got = browser.execute_script("return Object.keys(window.dt.got)")
        return sorted(int(key.split(" ")[1]) for key in got if key.startswith(channel + " "))

    def gaps():
        s = seqs("test:drift")
        return [b for a, b in zip(s, s[1:], strict=False) if b - a > 1]

    wait(browser, 60).until(lambda b: gaps())  # frames the server dropped for the page
    browser.execute_script("window.dt.slow = false; window.dt.client.unsubscribe('demo:flood:10', window.dt.take)")
    wait(browser, 30).until(lambda b: len([s for s in seqs("test:drift") if s > gaps()[-1]]) >= 5)
    last = seqs("test:drift")[-1]
    wait(browser, 30).until(lambda b: b.execute_script(f"return window.dt.plain[{last}] !== undefined"))
    browser.execute_script("window.dt.client.unsubscribe('test:drift', window.dt.take)")
    result = browser.execute_script("return window.dt")
    expected = {int(seq): data for seq, data in result["plain"].items()}  # a plain subscription's
    drift = {int(k.split(" ")[1]): v for k, v in result["got"].items() if k.startswith("test:drift ")}
    kinds = {int(k.split(" ")[1]): v for k, v in result["kinds"].items() if k.startswith("test:drift ")}
    common = [s for s in drift if s in expected]
    assert len(common) >= len(drift) // 2 and all(drift[s] == expected[s] for s in common)
    assert all(kinds[s] is False for s in gaps()) and any(kinds[s] for s in drift if s > gaps()[-1])

    history = "test:big-history"
    burst = f"return window.dt.client.call('test.publish_burst', {{channels: ['{history}'], count: 10, size: 2000}})"
    browser.execute_script(f"return window.dt.client.subscribe('{history}', window.dt.take, {{delta: 'fossil'}})")
    browser.execute_script(burst)
    wait(browser, 30).until(lambda b: len(seqs(history)) >= 10)
    browser.execute_script("window.dt.client.reconnect(3000)")
    wait(browser, 10).until(lambda b: b.execute_script("return window.dt.client.state") != "open")

    async def publish_while_away(rpc):
        answer = await rpc.call("test.publish_burst", {"channels": [history], "count": 10, "size": 2000})
        assert answer["result"] == 10

    first = seqs(history)[0]
    expected = asyncio.run(reference(history, first + 19, publish_while_away))
    wait(browser, 30).until(lambda b: b.execute_script("return window.dt.recovered") >= 10)
    result = browser.execute_script("return window.dt")
    kept = {int(k.split(" ")[1]): v for k, v in result["got"].items() if k.startswith(history + " ")}
    kinds = {int(k.split(" ")[1]): v for k, v in result["kinds"].items() if k.startswith(history + " ")}
    assert sorted(kept) == list(range(first, first + 20))  # each once, none missing
    assert all(kept[s] == expected[s] for s in range(first + 10, first + 20))  # the replay, exactly
    assert [kinds[s] for s in sorted(kept)] == [False] + [True] * 9 + [False] * 10  # deltas, then replayed whole
