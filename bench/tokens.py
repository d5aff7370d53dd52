"""What a connection token and the publish API cost, side by side in one run.

One daphne process of the bench site on Redis (a key prefix of its own), the demo users on
a fresh SQLite file. **Handshakes**: ``--handshakes`` WebSocket handshakes of user ``demo``,
``--concurrency`` at a time, each open → ``ping`` → close — signed in with the session
cookie (the session read from the database), then with ``Authorization: Bearer`` (the
token verified and the user read by primary key); rounds alternate so that both see the
same machine. **Publish API**: ``--publications`` publications through ``POST
/realtime/api/publish``, one per request (eight requests at a time), then five times as
many in batches of 100. Prints handshakes per second and p50/p99 per handshake, the
publications per second, and the token / cookie ratio.

Usage: REDIS_URL=redis://127.0.0.1:6379/0 python bench/tokens.py [--handshakes 1000]
           [--concurrency 20] [--publications 2000] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
import websockets

from bench.common import ROOT, daphne, free_port, percentile, prepare_database, processes, progress

KEY = "bench-publish-key"


async def handshakes(url: str, headers: dict[str, str], count: int, concurrency: int) -> tuple[float, list[float]]:
    """``count`` handshakes, ``concurrency`` at a time: per second, and each one's seconds."""
    took: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            started = time.perf_counter()
            async with websockets.connect(url, origin="http://127.0.0.1", additional_headers=headers) as ws:
                await ws.send('{"jsonrpc": "2.0", "method": "ping", "id": 1}')
                await ws.recv()
            took.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    return count / (time.perf_counter() - started), took


def post(url: str, body: bytes) -> int:
    request = urllib.request.Request(
        url, data=body, headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.status


def publish_api(base: str, count: int, batch: int, concurrency: int) -> float:
    """Publications per second through the API, ``batch`` per request."""
    url = f"{base}/realtime/api/publish"
    if batch == 1:
        bodies = [json.dumps({"channel": "demo:events", "data": {"n": n}}).encode() for n in range(count)]
    else:
        batches = [
            [{"channel": "demo:events", "data": {"n": n + i}} for i in range(batch)] for n in range(0, count, batch)
        ]
        bodies = [json.dumps({"publications": items}).encode() for items in batches]
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        statuses = list(pool.map(lambda body: post(url, body), bodies))
    assert all(s == 202 for s in statuses), statuses[:5]
    return count / (time.perf_counter() - started)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--handshakes", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--publications", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"rt-bench-tokens-{secrets.token_hex(3)}"
    database = prepare_database(str(Path(tempfile.mkdtemp()) / "db.sqlite3"))
    overrides = {  # one user opens them all: its own limits off (the handshake is what is measured)
        **{"HANDSHAKES_PER_S": 0, "MAX_CONNECTIONS_PER_USER": 0, "ADMISSION_BUCKET_CAPACITY": 0},
        **{"ADMISSION_CLOSE_AFTER_REFUSALS": 0, "PUBLISH_API_KEYS": [KEY]},
    }
    env = {
        **database,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "REDIS_URL": redis_url,
        "REALTIME_KEY_PREFIX": prefix,
        "REALTIME_BENCH_OVERRIDES": json.dumps(overrides),
    }
    token = subprocess.run(  # noqa: ASYNC221  (before anything runs)
        [sys.executable, "manage.py", "realtime_token", "demo", "--ttl", "3600"],
        cwd=ROOT,
        env={**os.environ, **env, "DJANGO_SETTINGS_MODULE": "project.settings"},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    port = free_port()
    results: dict[str, object] = {}
    try:
        with processes([daphne(port)], [port], env):
            base = f"http://127.0.0.1:{port}"
            from tests.support.servers import login

            cookie = login(base, "demo", "demo")
            ws = f"ws://127.0.0.1:{port}/realtime/"
            ways = {"cookie": {"Cookie": cookie}, "token": {"Authorization": f"Bearer {token}"}}
            rates: dict[str, list[float]] = {way: [] for way in ways}
            took: dict[str, list[float]] = {way: [] for way in ways}
            await handshakes(ws, ways["cookie"], 50, args.concurrency)  # warm-up
            for round_ in range(4):
                for way, headers in ways.items():
                    progress(f"handshakes, round {round_ + 1} of 4: {way}")
                    rate, each = await handshakes(ws, headers, args.handshakes // 4, args.concurrency)
                    rates[way].append(rate)
                    took[way] += each
            for way in ways:
                results[f"{way}_handshakes_per_s"] = round(sum(rates[way]) / len(rates[way]), 1)
                results[f"{way}_p50_ms"] = round(percentile(took[way], 50) * 1000, 1)
                results[f"{way}_p99_ms"] = round(percentile(took[way], 99) * 1000, 1)
            progress("the publish API: one publication per request")
            results["api_single_per_s"] = round(publish_api(base, args.publications, 1, 8), 1)
            progress("the publish API: batches of 100")
            results["api_batch_per_s"] = round(publish_api(base, args.publications * 5, 100, 8), 1)
    finally:
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()
    print(json.dumps(results, indent=2))
    ratio = results["token_handshakes_per_s"] / results["cookie_handshakes_per_s"]  # type: ignore[operator]
    print(f"handshakes per second, token / cookie = {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
