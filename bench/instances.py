"""Channels per object: instances of templates vs the same load on listed channels.

One daphne process of the bench site (embedded default: in-memory layer) per phase, each
phase beside its twin in the same run:

* ``rooms``: N connections, each subscribed to a channel of its own — ``bench:room:<i>``
  (instances of one template) or ``bench:listed-room-<i>`` (N channels listed at import).
  Printed: the server's memory per subscribed channel (RSS after the subscribes minus RSS
  with the same connections before them, over N) and the subscribe latency p50/p99.
* ``lots``: L app-fed lots, each watched at 3 cadences (250, 1000, 2000 ms) by one
  subscription, while the server publishes ``rate`` new prices a second on each —
  ``bench:lot:<i>`` (a template) or ``bench:listed-lot-<i>`` (L listed app-fed families).
  Printed: publications, frames delivered (the cadences' saving), and the server's CPU
  per delivered frame; the ratio template / listed is the cost of resolving instances.

Usage:  python bench/instances.py [--rooms 10000] [--lots 1000] [--rate 10] [--seconds 10]
            [--json FILE]

The client side opens up to ``--rooms`` sockets: the script raises its own open-file limit
to the hard limit (and says so); the server inherits it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import websockets

from bench.common import as_new_client, cpu_seconds, daphne, free_port, percentile, processes, progress, rss_bytes

CADENCES = (250, 1000, 2000)
#: What the server's own bounds would refuse of ten thousand anonymous sockets opened at
#: once from one machine (the process ceiling, the anonymous handshake rate) and of 3,000
#: app-fed cadences (each a lease, counted by MAX_TICKERS), switched off: this measures
#: channels, not the gate.
OVERRIDES = {"MAX_CONNECTIONS": 0, "MAX_ANONYMOUS_HANDSHAKES_PER_S": 0, "HANDSHAKES_PER_S": 0, "MAX_TICKERS": 0}
PER_CONNECTION = 30  # subscriptions per connection in the lots phase (10 lots x 3 cadences)


def raise_file_limit(wanted: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, wanted)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def connect(url: str) -> Any:
    return await websockets.connect(
        url, origin="http://127.0.0.1", max_size=None, open_timeout=60, ping_interval=None,
        compression=None, additional_headers=as_new_client(),
    )  # fmt: skip


async def subscribe(ws: Any, channel: str, request_id: int) -> float:
    """Subscribe and wait for the answer (frames before it are skipped): seconds taken."""
    started = time.perf_counter()
    await ws.send(
        json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": channel}, "id": request_id})
    )
    while True:
        message = json.loads(await ws.recv())
        if isinstance(message, dict) and message.get("id") == request_id:
            if "error" in message:
                raise RuntimeError(f"subscribe {channel}: {message['error']}")
            return time.perf_counter() - started


async def rooms_phase(kind: str, count: int) -> dict[str, Any]:
    port = free_port()
    env = {
        "BENCH_LISTED_ROOMS": str(count if kind == "listed" else 0),
        "REALTIME_BENCH_OVERRIDES": json.dumps(OVERRIDES),
    }
    with processes([daphne(port)], [port], env) as (server,):
        url = f"ws://127.0.0.1:{port}/realtime/"
        sem = asyncio.Semaphore(200)

        async def one() -> Any:
            async with sem:
                return await connect(url)

        sockets = await asyncio.gather(*(one() for _ in range(count)))
        progress(f"rooms/{kind}: {count} connections open")
        before = rss_bytes(server.pid)
        name = "bench:listed-room-{}" if kind == "listed" else "bench:room:{}"

        async def sub(i: int) -> float:
            async with sem:
                return await subscribe(sockets[i], name.format(i), 1)

        latencies = await asyncio.gather(*(sub(i) for i in range(count)))
        after = rss_bytes(server.pid)
        progress(f"rooms/{kind}: {count} subscribed")
        await asyncio.gather(*(ws.close() for ws in sockets))
    return {
        "channels": count,
        "rss_before_mib": round(before / 2**20, 1),
        "rss_after_mib": round(after / 2**20, 1),
        "bytes_per_channel": round((after - before) / count),
        "subscribe_p50_ms": round(percentile([x * 1000 for x in latencies], 50), 2),
        "subscribe_p99_ms": round(percentile([x * 1000 for x in latencies], 99), 2),
    }


async def lots_phase(kind: str, lots: int, rate: float, seconds: float) -> dict[str, Any]:
    port = free_port()
    env = {"BENCH_LISTED_LOTS": str(lots if kind == "listed" else 0), "REALTIME_BENCH_OVERRIDES": json.dumps(OVERRIDES)}
    name = "bench:listed-lot-{}" if kind == "listed" else "bench:lot:{}"
    with processes([daphne(port)], [port], env) as (server,):
        url = f"ws://127.0.0.1:{port}/realtime/"
        channels = [f"{name.format(lot)}:{ms}" for lot in range(lots) for ms in CADENCES]
        groups = [channels[i : i + PER_CONNECTION] for i in range(0, len(channels), PER_CONNECTION)]
        sockets = [await connect(url) for _ in groups]
        for ws, group in zip(sockets, groups, strict=True):
            for n, channel in enumerate(group, 1):
                await subscribe(ws, channel, n)
        progress(f"lots/{kind}: {len(channels)} subscriptions on {len(sockets)} connections")
        frames = [0]
        stop = asyncio.Event()

        async def read(ws: Any) -> None:
            while not stop.is_set():
                try:
                    text = await asyncio.wait_for(ws.recv(), 0.5)
                except TimeoutError:
                    continue
                if '"method":"message"' in text:
                    frames[0] += 1

        readers = [asyncio.create_task(read(ws)) for ws in sockets]
        driver = await connect(url)
        cpu0, frames0 = cpu_seconds(server.pid), frames[0]
        await driver.send(json.dumps({
            "jsonrpc": "2.0", "method": "bench.bids", "id": 1,
            "params": {"lots": lots, "rate": rate, "seconds": seconds, "listed": kind == "listed"},
        }))  # fmt: skip
        answer = json.loads(await asyncio.wait_for(driver.recv(), seconds * 10 + 60))
        await asyncio.sleep(2.5)  # the slowest cadence's last frames
        cpu, delivered = cpu_seconds(server.pid) - cpu0, frames[0] - frames0
        stop.set()
        await asyncio.gather(*readers)
        await asyncio.gather(driver.close(), *(ws.close() for ws in sockets))
    if "result" not in answer:
        raise RuntimeError(f"bench.bids: {answer}")
    published = answer["result"]["published"]
    return {
        "subscriptions": len(channels),
        "published": published,
        "published_per_s": round(published / answer["result"]["seconds"]),
        "frames_delivered": delivered,
        "frames_per_publication": round(delivered / max(published, 1), 3),
        "server_cpu_s": round(cpu, 2),
        "cpu_us_per_frame": round(cpu / max(delivered, 1) * 1e6, 1),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rooms", type=int, default=10000)
    parser.add_argument("--lots", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=10.0, help="bids a second on each lot")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    limit = raise_file_limit(args.rooms * 2 + 1000)
    print(f"open-file limit of this run: {limit}", flush=True)
    out: dict[str, Any] = {"rooms": {}, "lots": {}}
    for kind in ("listed", "template"):
        out["rooms"][kind] = await rooms_phase(kind, args.rooms)
    for kind in ("listed", "template"):
        out["lots"][kind] = await lots_phase(kind, args.lots, args.rate, args.seconds)
    rooms, lots = out["rooms"], out["lots"]
    print(f"\nrooms: {args.rooms} connections, each on a channel of its own")
    print(f"{'':10} {'bytes/channel':>14} {'subscribe p50':>14} {'p99 ms':>8}")
    for kind in ("listed", "template"):
        r = rooms[kind]
        print(f"{kind:10} {r['bytes_per_channel']:>14} {r['subscribe_p50_ms']:>14} {r['subscribe_p99_ms']:>8}")
    print(f"\nlots: {args.lots} lots x cadences {CADENCES} ms, {args.rate:g} bids/s each, {args.seconds:g} s")
    print(f"{'':10} {'published':>10} {'frames':>8} {'frames/pub':>10} {'CPU µs/frame':>13}")
    for kind in ("listed", "template"):
        r = lots[kind]
        line = f"{r['published']:>10} {r['frames_delivered']:>8} {r['frames_per_publication']:>10}"
        print(f"{kind:10} {line} {r['cpu_us_per_frame']:>13}")
    ratio = lots["template"]["cpu_us_per_frame"] / max(lots["listed"]["cpu_us_per_frame"], 1e-9)
    mem = rooms["template"]["bytes_per_channel"] / max(rooms["listed"]["bytes_per_channel"], 1)
    print(f"\ntemplate / listed: CPU per delivered frame {ratio:.2f}x (goal <= 1.2x), memory per channel {mem:.2f}x")
    out["ratios"] = {"cpu_per_frame": round(ratio, 3), "memory_per_channel": round(mem, 3)}
    if args.json:
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(out, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
