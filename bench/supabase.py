"""Supabase Realtime's broadcast benchmark #1, scaled to this machine: each user in a
1-user echo channel and a 6-user broadcast channel, 2 messages a second per channel.

Two daphne processes of the bench site on Redis (``--processes``); ``--users`` WebSocket
clients (raw JSON-RPC, one process), split over them. User ``u`` subscribes to
``bench:room:<u>`` (its echo channel) and to ``bench:room:<R + u // 6>`` (its room of
six); it publishes to its echo channel twice a second and to its room every 3 s (six
members: twice a second per room), each message carrying its send time. Every publication
goes client → server → backplane → every subscriber. After ``--warmup`` seconds the
script counts for ``--seconds``: deliveries per second (a message received by one
subscriber), their latency (receive time − send time: publish request, Redis and the
fan-out), p50/p95/p99, the publishes refused, and the servers' CPU.

Usage:  REDIS_URL=redis://127.0.0.1:6379/0 python bench/supabase.py [--users 600]
            [--seconds 30] [--warmup 5] [--processes 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench.common import cpu_seconds, daphne, drop_keys, free_port, open_ws, percentile, processes, progress, redis_site

ROOM = 6  # users per broadcast channel
RATE = 2.0  # messages a second per channel


class Tally:
    """Deliveries and their latencies while ``recording``."""

    def __init__(self) -> None:
        self.recording = False
        self.delivered = 0
        self.latencies: list[float] = []
        self.sent = 0
        self.refused = 0


async def user(
    url: str, u: int, rooms_base: int, tally: Tally, stop: asyncio.Event, ready: list[int], sem: asyncio.Semaphore
) -> None:
    echo, room = f"bench:room:{u}", f"bench:room:{rooms_base + u // ROOM}"
    async with sem:
        ws = await open_ws(url)
        for i, channel in enumerate((echo, room), start=1):
            await ws.send(
                json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": channel}, "id": i})
            )
            answer = json.loads(await ws.recv())
            if "result" not in answer:
                raise RuntimeError(f"subscribe refused: {answer}")
    ready[0] += 1
    ids = itertools.count(10)

    async def read() -> None:
        async for text in ws:
            message = json.loads(text)
            if message.get("method") == "message":
                if tally.recording:
                    tally.delivered += 1
                    tally.latencies.append((time.time() - message["params"]["data"]["t"]) * 1000)
            elif "error" in message and tally.recording:
                tally.refused += 1

    async def write() -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (u % 20) / 20 / RATE  # users spread over the period
        tick = 0
        while not stop.is_set():
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            channels = [echo] + ([room] if tick % ROOM == u % ROOM else [])  # one member a tick per room
            for channel in channels:
                params = {"channel": channel, "data": {"t": time.time(), "u": u}}
                await ws.send(json.dumps({"jsonrpc": "2.0", "method": "publish", "params": params, "id": next(ids)}))
                if tally.recording:
                    tally.sent += 1
            tick += 1
            deadline += 1 / RATE

    reader = asyncio.create_task(read())
    try:
        await write()
    finally:
        reader.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await reader
        with contextlib.suppress(Exception):
            await ws.close()


async def run(args: argparse.Namespace, urls: list[str], pids: list[int]) -> dict[str, Any]:
    tally, stop, ready, sem = Tally(), asyncio.Event(), [0], asyncio.Semaphore(50)
    rooms_base = args.users  # echo channels are 0..users-1, rooms after them
    tasks = [
        asyncio.create_task(user(urls[u % len(urls)], u, rooms_base, tally, stop, ready, sem))
        for u in range(args.users)
    ]
    while ready[0] < args.users:
        await asyncio.sleep(1)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        progress(f"{ready[0]}/{args.users} users subscribed")
    await asyncio.sleep(args.warmup)
    cpu0, t0 = sum(cpu_seconds(p) for p in pids), time.monotonic()
    tally.recording = True
    while (elapsed := time.monotonic() - t0) < args.seconds:
        await asyncio.sleep(min(5.0, args.seconds - elapsed))
        progress(f"{elapsed:.0f}/{args.seconds:.0f} s, {tally.delivered} deliveries")
    tally.recording = False
    wall, cpu = time.monotonic() - t0, sum(cpu_seconds(p) for p in pids) - cpu0
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    rooms = -(-args.users // ROOM)
    expected = args.users * RATE + rooms * RATE * ROOM  # echo + each room's messages to its members
    return {
        "users": args.users,
        "processes": len(urls),
        "channels": args.users + rooms,
        "seconds": wall,
        "publishes_per_s": tally.sent / wall,
        "deliveries_per_s": tally.delivered / wall,
        "expected_deliveries_per_s": expected,
        "refused": tally.refused,
        "p50_ms": percentile(tally.latencies, 50),
        "p95_ms": percentile(tally.latencies, 95),
        "p99_ms": percentile(tally.latencies, 99),
        "server_cpu_cores": cpu / wall,
    }


def report(row: dict[str, Any]) -> None:
    print(
        f"{row['users']} users, {row['channels']} channels, {row['processes']} daphne process(es): "
        f"{row['publishes_per_s']:.0f} publishes/s, {row['deliveries_per_s']:.0f} deliveries/s "
        f"(of {row['expected_deliveries_per_s']:.0f}), {row['refused']} refused; "
        f"latency p50 {row['p50_ms']:.1f} ms, p95 {row['p95_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms; "
        f"servers {100 * row['server_cpu_cores']:.0f} % of a core"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=600)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--warmup", type=float, default=5)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # Opening hundreds of sockets at once is admission, not this workload.
    url, prefix, env = redis_site({"MAX_ANONYMOUS_HANDSHAKES_PER_S": 0, "HANDSHAKES_PER_S": 0})
    ports = [free_port() for _ in range(args.processes)]
    try:
        with processes([daphne(p) for p in ports], ports, env) as procs:
            row = await run(args, [f"ws://127.0.0.1:{p}/realtime/" for p in ports], [p.pid for p in procs])
    finally:
        drop_keys(url, prefix)
    report(row)
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
