"""Idle rooms: what a process holding many presence rooms nobody speaks in costs, beside
the same process holding none, in one run.

One daphne process of the bench site (on Redis with ``--backplane redis``, a key prefix
of its own; in memory otherwise) per phase: ``--sockets`` idle anonymous sockets, each a
client of its own, and

* **none**: they subscribe nothing;
* **rooms**: they hold ``--rooms`` presence rooms between them (``demo:room:<slug>``,
  a presence channel with history: an instance each), and say nothing more.

After ``--settle`` seconds the server's CPU is read over ``--seconds``: printed per phase
as a share of one core, and the ratio rooms / none (the goal: under 1.2). Found: 20,000
idle rooms kept daphne at 85 % of a core, their presence parts renewed every beat.

Usage: python bench/idle_rooms.py [--backplane redis|memory] [--sockets 200]
           [--rooms 20000] [--settle 10] [--seconds 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
import websockets

from bench.common import as_new_client, cpu_seconds, daphne, free_port, prepare_database, processes, progress

#: The bench measures upkeep, not the gate: the shares and buckets a real attacker meets
#: would stop the setup itself (200 sockets subscribing 100 rooms each at once).
OVERRIDES = {
    "MAX_CONNECTIONS": 0,
    "MAX_ANONYMOUS_HANDSHAKES_PER_S": 0,
    "HANDSHAKES_PER_S": 0,
    "ADMISSION_BUCKET_CAPACITY": 0,
    "MAX_INSTANCES_PER_TEMPLATE": 0,
    "MAX_INSTANCES": 0,
    "MAX_BACKPLANE_BYTES_PER_IDENTITY": 0,
    "MAX_SUBSCRIPTIONS": 0,
}


async def hold(url: str, rooms: list[str], ready: asyncio.Event, stop: asyncio.Event, failed: list[str]) -> None:
    """One idle socket: subscribes ``rooms`` (pipelined, answers read), then waits."""
    async with websockets.connect(
        url, origin="http://127.0.0.1", max_size=None, ping_interval=None, additional_headers=as_new_client()
    ) as ws:
        for n, room in enumerate(rooms):
            await ws.send(json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": room}, "id": n}))
        answered = 0
        while answered < len(rooms):
            message = json.loads(await ws.recv())
            if "id" in message:
                answered += 1
                if "error" in message:
                    failed.append(str(message["error"]))
        ready.set()
        while not stop.is_set():  # idle: read (and drop) whatever comes, say nothing
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ws.recv(), 1.0)


async def phase(name: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    port = free_port()
    with processes([daphne(port)], [port], env) as (server,):
        url = f"ws://127.0.0.1:{port}/realtime/"
        per = args.rooms // args.sockets if name == "rooms" else 0
        stop, failed = asyncio.Event(), []
        events = [asyncio.Event() for _ in range(args.sockets)]
        tasks = []
        for i, ready in enumerate(events):
            rooms = [f"demo:room:idle-{i}-{j}" for j in range(per)]
            tasks.append(asyncio.create_task(hold(url, rooms, ready, stop, failed)))
            if i % 20 == 19:
                await asyncio.sleep(0.05)
        for done, ready in enumerate(events, 1):
            await asyncio.wait_for(ready.wait(), 300)
            if done % 50 == 0:
                progress(f"{name}: {done}/{args.sockets} sockets ready")
        progress(f"{name}: {per * args.sockets} rooms held ({len(failed)} refused); settling {args.settle} s")
        await asyncio.sleep(args.settle)
        before, started = cpu_seconds(server.pid), time.monotonic()
        await asyncio.sleep(args.seconds)
        cpu = (cpu_seconds(server.pid) - before) / (time.monotonic() - started)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"phase": name, "rooms": per * args.sockets, "refused": len(failed), "cpu_share": round(cpu, 4)}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backplane", choices=["redis", "memory"], default="redis")
    parser.add_argument("--sockets", type=int, default=200)
    parser.add_argument("--rooms", type=int, default=20_000)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prefix = f"bench-idle-{secrets.token_hex(3)}"
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    overrides = {**OVERRIDES, "KEY_PREFIX": prefix}
    env = {"DJANGO_SETTINGS_MODULE": "bench.settings", "REALTIME_BENCH_OVERRIDES": json.dumps(overrides)}
    env["REDIS_URL"] = redis_url if args.backplane == "redis" else ""
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env.update(prepare_database(f"{tmp}/db.sqlite3"))
            for name in ("none", "rooms"):
                results.append(await phase(name, args, env))
    finally:
        if args.backplane == "redis":
            client = redis.Redis.from_url(redis_url)
            for key in client.scan_iter(match=f"{prefix}*"):
                client.delete(key)
    none, rooms = results
    print(f"idle rooms, {args.backplane} backplane, {args.sockets} idle sockets, {args.seconds:.0f} s measured")
    for result in results:
        print(f"  {result['phase']:>5}: {result['rooms']:>6} rooms  CPU {result['cpu_share'] * 100:5.1f} % of a core")
    ratio = rooms["cpu_share"] / none["cpu_share"] if none["cpu_share"] else float("inf")
    print(f"  rooms / none: {ratio:.2f}x (goal < 1.2)")
    if args.json:
        args.json.write_text(json.dumps({"backplane": args.backplane, "results": results, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
