"""The operations screen's states in headless chromium, on a real cluster of two daphne
processes on Redis: a process killed is shown ``gone`` (with since when) while the other
stays healthy; a probe that says the backplane is down — whole, or one shard of several —
is shown ``degraded`` with the reason in the card.

Found: only healthy cards (and a write-behind backlog) were ever rendered by a test: the
gone, degraded and down-shard states were not."""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest
import redis

from tests.support.browser import chromium, log_in, wait
from tests.support.servers import prepare_database, servers

pytestmark = [pytest.mark.browser, pytest.mark.cluster, pytest.mark.timeout(180)]

SCREEN = "/admin/realtime_app/realtimecluster/"


def card_states(browser) -> dict[str, tuple[str, str]]:
    """``{pid: (state, why)}`` of every card on the screen."""
    return browser.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('#rc-cards [data-instance]')].map(c => "
        "[c.dataset.instance.split('-').slice(-2)[0], "
        "[c.dataset.state, (c.querySelector('.why') || {}).textContent || '']]))"
    )


async def test_a_killed_process_is_gone_and_a_backplane_down_is_degraded_with_its_shard(tmp_path, redis_url):
    prefix = f"{os.environ['REALTIME_TEST_PREFIX']}-screen-{secrets.token_hex(3)}"
    env = {**prepare_database(str(tmp_path / "db.sqlite3")), "REDIS_URL": redis_url, "REALTIME_KEY_PREFIX": prefix}
    browser = await asyncio.to_thread(chromium)
    try:
        with servers(2, env) as (a, b):

            async def until(condition, seconds=30):
                return await asyncio.to_thread(wait(browser, seconds).until, condition)

            await asyncio.to_thread(log_in, browser, a.http, "admin", "admin")
            await asyncio.to_thread(browser.get, b.http + "/accounts/login/")  # b's hub starts with a request
            await asyncio.to_thread(browser.get, a.http + SCREEN)
            pids = {str(a.process.pid), str(b.process.pid)}

            def both(br):
                states = card_states(br)
                return states if set(states) == pids else False

            states = await until(both)
            assert {state for state, _ in states.values()} == {"healthy"}, states
            b.process.kill()  # no drain, no goodbye: its probe just stops

            def b_gone(br):
                states = card_states(br)
                return states if states.get(str(b.process.pid), ("",))[0] == "gone" else False

            gone = await until(b_gone, 60)
            assert gone[str(b.process.pid)][1].startswith("gone: no probe since"), gone
            assert gone[str(a.process.pid)][0] == "healthy"
            # The backplane down, as a's own probe would say it: fed to the page's renderer
            # (the live feed stopped first, so that the next real probe does not redraw it).
            script = """
                const rc = window.realtimeCluster;
                rc.client.close();
                const [entry] = [...rc.seen.values()].filter(e => !e.gone);
                const probe = structuredClone(entry.probe);
                const at = Date.now();
                probe.backplane = {...probe.backplane, up: false, shards: [
                  {index: 0, address: "r0:6379", up: true}, {index: 1, address: "r1:6379", up: false}]};
                rc.record({generated_at: at, instances: [probe]});
                const why = () => [...document.querySelectorAll('#rc-cards [data-state=degraded] .why')]
                  .map(e => e.textContent);
                const sharded = why();
                probe.backplane = {up: false};
                rc.record({generated_at: at + 1, instances: [probe]});
                const whole = why();
                return [sharded, whole];
            """
            sharded, whole = await asyncio.to_thread(browser.execute_script, script)
            assert sharded == ["backplane shard 1 (r1:6379) down"], sharded
            assert whole == ["backplane down"], whole
    finally:
        await asyncio.to_thread(browser.quit)
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()
