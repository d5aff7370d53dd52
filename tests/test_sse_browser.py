"""The SSE demo pages in headless chromium against a real daphne: the browser module over
Server-Sent Events and HTTP RPC only; its fallback when a WebSocket cannot open and its
return to the WebSocket once one can, with nothing lost; htmx's ``sse`` extension.

Found: a page on a network that breaks WebSockets had nothing to fall back to."""

from __future__ import annotations

import asyncio
import json

import pytest
from selenium.webdriver.common.by import By

from tests.support.browser import chromium, wait
from tests.support.servers import Server
from tests.support.sse import rpc

pytestmark = [pytest.mark.browser, pytest.mark.timeout(180)]

#: What a proxy that breaks WebSockets looks like to a page: every socket closes (1006)
#: before it opens, until the test lets them through.
BREAK_WEBSOCKETS = """
window.__breakWebSocket = true;
const RealWebSocket = window.WebSocket;
window.WebSocket = class extends EventTarget {
  constructor(url) {
    if (!window.__breakWebSocket) return new RealWebSocket(url);
    super();
    this.readyState = 0;
    setTimeout(() => { this.readyState = 3; if (this.onclose) this.onclose({ code: 1006, reason: "" }); }, 20);
  }
  send() { throw new Error("not open"); }
  close() {}
};
"""


@pytest.fixture(scope="module")
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


def publish(site, data):
    call = {"jsonrpc": "2.0", "method": "publish", "params": {"channel": "demo:events", "data": data}, "id": 1}
    status, body = asyncio.run(rpc(site.port, call))
    assert status == 200, body
    return body["result"]["seq"]


def test_the_sse_page_is_live_over_http_only(site, browser):
    browser.get(site.http + "/demo/sse/")
    wait(browser, 15).until(lambda b: text(b, "#state") == "open" and text(b, "#transport") == "sse")
    first = wait(browser, 10).until(lambda b: text(b, "#clock").isdigit() and text(b, "#clock"))
    wait(browser, 10).until(lambda b: text(b, "#clock") != first)
    browser.find_element(By.ID, "post-text").send_keys("hello over http")
    browser.find_element(By.CSS_SELECTOR, "#post-form button").click()
    wait(browser, 10).until(lambda b: "hello over http" in text(b, "#events"))
    seq = publish(site, {"from": "outside"})
    wait(browser, 10).until(lambda b: seq in b.execute_script("return window.realtime.seen"))
    sockets = browser.execute_script(
        "return performance.getEntriesByType('resource').filter(e => e.name.startsWith('ws')).length"
    )
    assert sockets == 0


def test_the_client_falls_back_to_sse_when_websockets_break_and_returns_without_a_loss(site, browser):
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": BREAK_WEBSOCKETS})
    browser.get(site.http + "/demo/sse/?transports=websocket,sse&retry_ws_ms=1500")
    wait(browser, 15).until(lambda b: text(b, "#state") == "open" and text(b, "#transport") == "sse")
    wait(browser, 10).until(lambda b: b.execute_script("return window.realtime.client._handlers.size") == 2)
    before = [publish(site, {"n": n}) for n in range(3)]
    wait(browser, 10).until(lambda b: before[-1] in b.execute_script("return window.realtime.seen"))
    browser.execute_script("window.__breakWebSocket = false")  # the network lets WebSockets through again
    wait(browser, 20).until(lambda b: text(b, "#transport") == "websocket" and text(b, "#state") == "open")
    after = [publish(site, {"n": n}) for n in range(3, 6)]
    wait(browser, 10).until(lambda b: after[-1] in b.execute_script("return window.realtime.seen"))
    seen = browser.execute_script("return window.realtime.seen")
    start = seen.index(before[0])
    assert seen[start:] == list(range(before[0], after[-1] + 1))  # each once, in order, across the switch


def test_the_htmx_page_swaps_events_in_with_no_script_of_its_own(site, browser):
    browser.get(site.http + "/demo/htmx/")
    tick = wait(browser, 15).until(lambda b: text(b, "#clock").startswith("{") and text(b, "#clock"))
    assert json.loads(tick)["channel"] == "demo:clock"  # the canonical name: the default cadence has no suffix
    wait(browser, 10).until(lambda b: text(b, "#clock") != tick)
    seq = publish(site, {"htmx": "swapped"})
    swapped = wait(browser, 10).until(lambda b: text(b, "#last-event").startswith("{") and text(b, "#last-event"))
    assert json.loads(swapped)["seq"] == seq and json.loads(swapped)["data"] == {"htmx": "swapped"}


def test_a_cadence_switch_over_sse_reopens_the_stream_before_the_old_one_goes(site, browser):
    browser.get(site.http + "/demo/sse/")
    wait(browser, 15).until(lambda b: text(b, "#state") == "open" and text(b, "#clock").isdigit())
    browser.execute_script("""
      window.fast = [];
      window.realtime.client.subscribe("demo:clock:250", (m) => window.fast.push([performance.now(), m.channel, m.ts]));
    """)
    wait(browser, 10).until(lambda b: b.execute_script("return window.fast.length") >= 3)
    assert {c for _, c, _ in browser.execute_script("return window.fast")} == {"demo:clock:250"}
    browser.execute_script("window.realtime.client.unsubscribe('demo:clock'); window.dropped = performance.now();")
    wait(browser, 10).until(
        lambda b: b.execute_script("return window.fast.filter(f => f[0] > window.dropped).length") >= 3
    )
    # by the ticks' own timestamps (the server's clock, not this busy browser's): no tick
    # missed at either switch
    times = [ts for _, _, ts in browser.execute_script("return window.fast")]
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 2 * 250 + 150
    assert browser.execute_script("return window.realtime.client.transport") == "sse"
