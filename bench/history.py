"""What history costs a publication, and how fast 1,000 missed events come back.

In one run, on a private redis-server (so that its command and CPU counters are this
benchmark's alone) and one daphne process of the demo site with ``--subscribers``
WebSocket clients on both channels: ``--publications`` publications on ``bench:events``
(an event channel without history) and on ``demo:events`` (history: 1,000 / 5 min),
alternated over ``--rounds``, each round waiting until every subscriber got every frame.
Per publication it reports the CPU of the benchmark process (the publisher and the
WebSocket clients), of the serving process and of Redis, and Redis commands (each call a
Lua script makes counts); then the ratio history / plain. Then ``--missed`` events are
published while a client is away and it resumes ``since`` its last position: the time
from sending the ``subscribe`` to its answer (every missed event received before it).

Usage: python bench/history.py [--publications 3000] [--rounds 3] [--subscribers 10]
       [--missed 1000] [--resumes 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
import websockets

from bench.common import as_new_client, cpu_seconds, daphne, free_port, percentile, processes, progress
from tests.support.private_redis import PrivateRedis

PLAIN, KEPT = "bench:events", "demo:events"


def redis_counters(r: redis.Redis) -> tuple[int, float]:
    """Commands served and CPU seconds used by Redis so far."""
    calls = sum(int(v["calls"]) for v in r.info("commandstats").values())
    cpu = r.info("cpu")
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


class Subscribers:
    """WebSocket clients on both channels, counting the frames of each."""

    def __init__(self) -> None:
        self.counts = {PLAIN: 0, KEPT: 0}
        self.tasks: list[asyncio.Task[None]] = []
        self.sockets: list[Any] = []

    async def start(self, url: str, n: int) -> None:
        for _ in range(n):
            ws = await websockets.connect(
                url, origin="http://127.0.0.1", additional_headers=as_new_client(), max_size=None, compression=None
            )
            for i, channel in enumerate((PLAIN, KEPT)):
                await ws.send(
                    json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": channel}, "id": i})
                )
                await ws.recv()
            self.sockets.append(ws)
            self.tasks.append(asyncio.create_task(self._read(ws)))

    async def _read(self, ws: Any) -> None:
        async for text in ws:
            message = json.loads(text)
            if message.get("method") == "message":
                self.counts[message["params"]["channel"]] += 1

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for ws in self.sockets:
            await ws.close()


async def measure(
    hub: Any, r: redis.Redis, server_pid: int, subs: Subscribers, channel: str, n: int, clients: int
) -> dict[str, float]:
    target = subs.counts[channel] + n * clients
    calls0, redis0 = redis_counters(r)
    server0, own0 = cpu_seconds(server_pid), time.process_time()
    for i in range(n):
        await hub.publish(channel, {"i": i, "text": "an event of about the size of a chat line"})
    own = time.process_time() - own0
    deadline = time.monotonic() + 60
    while subs.counts[channel] < target:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{channel}: {target - subs.counts[channel]} frames never arrived")
        await asyncio.sleep(0.01)
    server = cpu_seconds(server_pid) - server0
    calls1, redis1 = redis_counters(r)
    return {"publisher_s": own, "server_s": server, "redis_s": redis1 - redis0, "commands": calls1 - calls0 - 2}


async def resume_times(url: str, hub: Any, missed: int, resumes: int) -> list[float]:
    """Milliseconds from ``subscribe since`` to its answer, ``missed`` events behind."""
    times = []
    for round_ in range(resumes):
        async with websockets.connect(
            url, origin="http://127.0.0.1", additional_headers=as_new_client(), max_size=None
        ) as ws:
            await ws.send(json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": KEPT}, "id": 1}))
            while "id" not in (answer := json.loads(await ws.recv())):
                pass
            since = {"seq": answer["result"]["seq"], "epoch": answer["result"]["epoch"]}
        for i in range(missed):  # published while the client is away
            await hub.publish(KEPT, {"i": i, "text": "an event of about the size of a chat line"})
        async with websockets.connect(
            url, origin="http://127.0.0.1", additional_headers=as_new_client(), max_size=None
        ) as ws:
            request = {"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": KEPT, "since": since}, "id": 2}
            start = time.perf_counter()
            await ws.send(json.dumps(request))
            replayed = 0
            while not (text := await ws.recv()).startswith('{"jsonrpc":"2.0","result"'):
                replayed += 1  # a message notification (parsing each would time the client, not the resume)
            elapsed = (time.perf_counter() - start) * 1000
            result = json.loads(text)["result"]
            if not result["recovered"] or replayed != missed:
                raise RuntimeError(f"resume not whole: {result}, {replayed} replayed")
        times.append(elapsed)
        progress(f"resume {round_ + 1}/{resumes}: {missed} events in {elapsed:.1f} ms")
    return times


async def run(args: argparse.Namespace) -> dict[str, Any]:
    redis_server = PrivateRedis().start()
    port = free_port()
    env = {
        "REDIS_URL": redis_server.url,
        "REALTIME_KEY_PREFIX": "bench-history",
        "DJANGO_SETTINGS_MODULE": "bench.settings",
    }
    os.environ.update(env)
    import django

    django.setup()
    import bench.asgi  # noqa: F401  (registers bench:events here too)
    from realtime_app.hub import get_hub

    try:
        with processes([daphne(port)], [port], env) as (server,):
            url = f"ws://127.0.0.1:{port}/realtime/"
            hub = await get_hub()
            subs = Subscribers()
            await subs.start(url, args.subscribers)
            r = redis_server.client()
            totals: dict[str, dict[str, float]] = {PLAIN: {}, KEPT: {}}
            await measure(hub, r, server.pid, subs, PLAIN, 200, args.subscribers)  # warm up both paths
            await measure(hub, r, server.pid, subs, KEPT, 200, args.subscribers)
            for round_ in range(args.rounds):
                order = (PLAIN, KEPT) if round_ % 2 == 0 else (KEPT, PLAIN)
                for channel in order:
                    result = await measure(hub, r, server.pid, subs, channel, args.publications, args.subscribers)
                    for key, value in result.items():
                        totals[channel][key] = totals[channel].get(key, 0.0) + value
                    progress(f"round {round_ + 1}/{args.rounds}: {channel} done")
            await subs.stop()
            times = await resume_times(url, hub, args.missed, args.resumes)
            await hub.aclose()
    finally:
        redis_server.close()
    n = args.publications * args.rounds
    per = {channel: {key: value / n for key, value in t.items()} for channel, t in totals.items()}
    return {
        "publications": n,
        "subscribers": args.subscribers,
        "per_publication": per,
        "resume_ms": times,
        "missed": args.missed,
    }


def report(result: dict[str, Any]) -> None:
    per = result["per_publication"]
    print(f"\nPer publication ({result['publications']} each, {result['subscribers']} subscribers on one daphne):")
    print(f"{'':>14}{'publisher µs':>14}{'server µs':>11}{'Redis µs':>10}{'total µs':>10}{'Redis cmds':>12}")
    for label, channel in (("no history", PLAIN), ("history", KEPT)):
        p = per[channel]
        total = p["publisher_s"] + p["server_s"] + p["redis_s"]
        print(
            f"{label:>14}{p['publisher_s'] * 1e6:>14.1f}{p['server_s'] * 1e6:>11.1f}{p['redis_s'] * 1e6:>10.1f}"
            f"{total * 1e6:>10.1f}{p['commands']:>12.2f}"
        )
    plain, kept = per[PLAIN], per[KEPT]
    cpu_ratio = sum(kept[k] for k in ("publisher_s", "server_s", "redis_s")) / sum(
        plain[k] for k in ("publisher_s", "server_s", "redis_s")
    )
    commands = kept["commands"] / plain["commands"]
    print(f"history / no history: CPU {cpu_ratio:.2f}×, Redis commands {commands:.2f}× (goal ≤ 1.3×)")
    times = result["resume_ms"]
    print(
        f"resume of {result['missed']} missed events: p50 {percentile(times, 50):.1f} ms, "
        f"max {max(times):.1f} ms over {len(times)} (goal < 100 ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--publications", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--subscribers", type=int, default=10)
    parser.add_argument("--missed", type=int, default=1000)
    parser.add_argument("--resumes", type=int, default=10)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
