"""Slow consumers: what 5 clients that never read cost a daphne process, guard on vs off.

One run, three phases on fresh daphne processes of the demo site (in-memory layer):

* ``clean``   — 100 healthy clients on ``demo:clock:100``, no dead client (guard on);
* ``guarded`` — the same plus 5 clients on ``demo:flood:<ms>`` that never read (guard on:
  4 MiB, drop, close after a balance of 1000);
* ``unguarded`` — the same with ``MAX_BACKPRESSURE = 0``.

It prints the server's RSS slope (MB/min, least squares over the phase), the healthy
clients' p99 latency and its ratio to ``clean``, drops and 1013 closes (from the probe).

Then the nominal-path cost: 100 reading clients on ``demo:clock:<fast>``, guard on vs off,
alternated ``--rounds`` times; server CPU per 1000 delivered frames and the ratio.

Usage: python bench/slow_consumer.py [--seconds 60] [--dead 5] [--healthy 100] [--flood-ms 20]
       [--rounds 4] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    ROOT,
    Collector,
    as_new_client,
    client,
    cpu_seconds,
    daphne,
    free_port,
    percentile,
    prepare_database,
    processes,
    progress,
    rss_bytes,
)

MIB = 1024 * 1024


def slope_mb_per_min(samples: list[tuple[float, int]]) -> float:
    xs = [t for t, _ in samples]
    ys = [r / MIB for _, r in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


async def dead_client(url: str, channel: str, stop: asyncio.Event) -> None:
    import websockets

    async with websockets.connect(
        url, origin="http://127.0.0.1", additional_headers=as_new_client(), max_size=None, compression=None
    ) as ws:
        await ws.send(json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": channel}, "id": 1}))
        await ws.recv()
        ws.transport.pause_reading()  # never reads again
        await stop.wait()


def probe_totals(port: int, cookie: str) -> dict[str, Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/realtime/api/health", headers={"Cookie": cookie})
    return json.loads(urllib.request.urlopen(request).read())["totals"]


async def phase(name: str, env: dict[str, str], args: argparse.Namespace, dead: int) -> dict[str, Any]:
    from tests.support.servers import login

    port = free_port()
    with processes([daphne(port, "project.asgi:application")], [port], env) as procs:
        pid = procs[0].pid
        cookie = login(f"http://127.0.0.1:{port}", "admin", "admin")
        url = f"ws://127.0.0.1:{port}/realtime/"
        stop = asyncio.Event()
        collector = Collector()
        connected = [0]
        sem = asyncio.Semaphore(50)
        healthy = [
            asyncio.create_task(client(url, collector, "demo:clock:100", asyncio.Event(), connected, stop, sem))
            for _ in range(args.healthy)
        ]
        dead_tasks = [asyncio.create_task(dead_client(url, f"demo:flood:{args.flood_ms}", stop)) for _ in range(dead)]
        while connected[0] < args.healthy:
            await asyncio.sleep(0.2)
        collector.recording = True
        samples: list[tuple[float, int]] = []
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < args.seconds:
            samples.append((elapsed, rss_bytes(pid)))
            if len(samples) % 10 == 0:
                progress(f"{name}: {elapsed:.0f}/{args.seconds:.0f} s, RSS {samples[-1][1] / MIB:.0f} MiB")
            await asyncio.sleep(0.5)
        collector.recording = False
        totals = await asyncio.to_thread(probe_totals, port, cookie)
        stop.set()
        for task in healthy + dead_tasks:
            task.cancel()
        await asyncio.gather(*healthy, *dead_tasks, return_exceptions=True)
    return {
        "phase": name,
        "rss_slope_mb_per_min": slope_mb_per_min(samples),
        "rss_start_mib": samples[0][1] / MIB,
        "rss_end_mib": samples[-1][1] / MIB,
        "healthy_p50_ms": percentile(collector.latencies, 50),
        "healthy_p99_ms": percentile(collector.latencies, 99),
        "healthy_frames": collector.frames,
        "drops": totals["drops"],
        "closes": totals["closes"],
        "series": samples,
    }


async def nominal(env_on: dict[str, str], env_off: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    """Guarded vs unguarded send: server CPU per 1000 frames, rounds alternated."""
    results: dict[str, list[float]] = {"on": [], "off": []}
    for round_ in range(args.rounds):
        for label, env in (("on", env_on), ("off", env_off)) if round_ % 2 == 0 else (("off", env_off), ("on", env_on)):
            port = free_port()
            with processes([daphne(port, "project.asgi:application")], [port], env) as procs:
                pid = procs[0].pid
                url = f"ws://127.0.0.1:{port}/realtime/"
                stop, collector, connected = asyncio.Event(), Collector(), [0]
                sem = asyncio.Semaphore(50)
                tasks = [
                    asyncio.create_task(
                        client(url, collector, f"demo:clock:{args.fast_ms}", asyncio.Event(), connected, stop, sem)
                    )
                    for _ in range(args.healthy)
                ]
                while connected[0] < args.healthy:
                    await asyncio.sleep(0.2)
                await asyncio.sleep(1)
                cpu0, collector.recording = cpu_seconds(pid), True
                await asyncio.sleep(args.nominal_seconds)
                collector.recording = False
                cpu = cpu_seconds(pid) - cpu0
                stop.set()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            results[label].append(1000 * cpu / max(1, collector.frames))
            progress(f"nominal round {round_ + 1}/{args.rounds}, guard {label}: {results[label][-1]:.4f} s/1000 frames")
    on, off = statistics.median(results["on"]), statistics.median(results["off"])
    return {"guard_on_cpu_s_per_1000": on, "guard_off_cpu_s_per_1000": off, "ratio": on / off, "rounds": results}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for row in results:
        ts, rs = zip(*row["series"], strict=True)
        ax.plot(ts, [r / MIB for r in rs], label=f"{row['phase']} ({row['rss_slope_mb_per_min']:+.1f} MB/min)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title("daphne RSS with 5 clients that never read")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--dead", type=int, default=5)
    parser.add_argument("--healthy", type=int, default=100)
    parser.add_argument("--flood-ms", type=int, default=20)
    parser.add_argument("--fast-ms", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--nominal-seconds", type=float, default=8)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    import tempfile

    os.chdir(ROOT)
    db = prepare_database(str(Path(tempfile.mkdtemp()) / "db.sqlite3"))
    base = {
        **db,
        "REDIS_URL": "",
        "REALTIME_DEMO_FLOOD": "1",
        "REALTIME_LOG_LEVEL": "ERROR",
        "DJANGO_SETTINGS_MODULE": "project.settings",
    }
    on, off = {**base}, {**base, "REALTIME_MAX_BACKPRESSURE": "0"}
    results = [
        await phase("clean", on, args, 0),
        await phase("guarded", on, args, args.dead),
        await phase("unguarded", off, args, args.dead),
    ]
    cost = await nominal(on, off, args)
    clean_p99 = results[0]["healthy_p99_ms"]
    print(
        f"{'phase':<10}{'RSS MB/min':>11}{'RSS start→end MiB':>20}{'p50 ms':>8}{'p99 ms':>8}{'p99/clean':>10}"
        f"{'drops':>8}{'1013':>6}"
    )
    for row in results:
        span = f"{row['rss_start_mib']:.0f} → {row['rss_end_mib']:.0f}"
        ratio = row["healthy_p99_ms"] / clean_p99
        print(
            f"{row['phase']:<10}{row['rss_slope_mb_per_min']:>11.1f}{span:>20}{row['healthy_p50_ms']:>8.1f}"
            f"{row['healthy_p99_ms']:>8.1f}{ratio:>10.2f}{row['drops']:>8}{row['closes']:>6}"
        )
    print(
        f"\nnominal path, server CPU per 1000 frames: guard on {cost['guard_on_cpu_s_per_1000']:.4f} s, "
        f"off {cost['guard_off_cpu_s_per_1000']:.4f} s, ratio {cost['ratio']:.3f} (median of {args.rounds} rounds)"
    )
    if args.json:
        args.json.write_text(json.dumps({"phases": results, "nominal": cost}, indent=2))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    asyncio.run(main())
