"""Fan-out cost: realtime_app's per-process hub vs plain Channels group_send vs bare websockets.

Two daphne (or, with ``--server uvicorn``, uvicorn) processes on Redis serve both
endpoints (``--processes 1``: one, as the bare server runs); N WebSocket clients are split
over them, all on one channel. In the same run,
for each N, three phases measure delivered frames/s, p50/p99 latency (client clock −
server ``ts``), server CPU seconds per 1000 delivered frames and Redis commands per
publication:

* ``hub``: clients subscribe to ``demo:clock:<ms>`` on ``/realtime/`` (one ticker in the
  cluster, one backplane message per subscribed process, local fan-out);
* ``channels``: clients connect to ``/baseline/``, a plain ``AsyncWebsocketConsumer`` in a
  group, fed by ``group_send`` from this script at the same cadence;
* ``websockets``: a bare ``websockets`` broadcast server (one process), the physical floor.

Usage:  REDIS_URL=redis://127.0.0.1:6379/0 python bench/fanout.py [--clients 100 1000]
            [--seconds 10] [--interval-ms 100] [--server daphne [uvicorn]] [--processes 2]
            [--rounds 1] [--no-channels] [--json FILE] [--plot FILE]
        ... python bench/fanout.py --daphne-write direct prepared message [--clients ...]

``--rounds R`` measures the hub and the bare server R times each for every client count,
alternating which goes first, and prints each round's ratios and their median and range: on
a shared machine the floor itself moves between windows, so a ratio is read from windows
taken side by side. The plain Channels phase runs after the rounds (once). ``--server
daphne uvicorn`` measures both, one after the other; ``--plot`` draws each round's ratios
beside the goals.

``--daphne-write`` compares, in one run, how daphne's hub path writes the frame built once
per publication (``DaphneTransport.write_mode``): ``direct`` to the socket, autobahn's
public ``prepared`` message, or ``message`` (framed again per connection) — each against
the bare websockets server.
With no --interval-ms, 100 ms below 1000 clients and 1000 ms from 1000 on (at 10 publications
per second, 1000 plain-Channels consumers saturate this 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from bench.common import (
    Collector,
    client,
    cpu_seconds,
    daphne,
    drop_keys,
    free_port,
    percentile,
    processes,
    progress,
    redis_site,
    uvicorn,
)


def redis_commands(r: redis.Redis) -> int:
    stats = r.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


async def run_phase(
    kind: str,
    urls: list[str],
    n: int,
    interval_ms: int,
    seconds: float,
    pids: list[int],
    r: redis.Redis,
    layer: Any = None,
) -> dict[str, Any]:
    collector = Collector()
    stop = asyncio.Event()
    ready = asyncio.Event()
    connected = [0]
    sem = asyncio.Semaphore(50)
    channel = f"demo:clock:{interval_ms}" if kind == "hub" else None
    tasks = [
        asyncio.create_task(client(urls[i % len(urls)], collector, channel, ready, connected, stop, sem))
        for i in range(n)
    ]
    while connected[0] < n:
        await asyncio.sleep(0.5)
        progress(f"{kind}: {connected[0]}/{n} clients connected")
    publisher = None
    published = [0]
    if kind == "channels":
        publisher = asyncio.create_task(baseline_publisher(layer, interval_ms, published, stop))
    await asyncio.sleep(max(1.0, 2 * interval_ms / 1000))  # warm up
    cpu0 = sum(cpu_seconds(p) for p in pids)
    cmd0 = redis_commands(r)
    t0 = time.monotonic()
    pub0 = published[0]
    collector.recording = True
    while (elapsed := time.monotonic() - t0) < seconds:
        await asyncio.sleep(min(2.0, seconds - elapsed))
        progress(f"{kind} n={n}: {elapsed + 0.0:.0f}/{seconds:.0f} s, {collector.frames} frames")
    collector.recording = False
    wall = time.monotonic() - t0
    cpu = sum(cpu_seconds(p) for p in pids) - cpu0
    commands = redis_commands(r) - cmd0
    publications = (published[0] - pub0) if kind == "channels" else wall * 1000 / interval_ms
    stop.set()
    if publisher:
        await publisher  # not cancel(): a cancelled group_send may swallow the cancellation
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await settle(pids)
    frames = collector.frames
    return {
        "kind": kind,
        "clients": n,
        "interval_ms": interval_ms,
        "frames_per_s": frames / wall,
        "expected_per_s": n * 1000 / interval_ms,
        "p50_ms": percentile(collector.latencies, 50),
        "p99_ms": percentile(collector.latencies, 99),
        "cpu_s_per_1000": 1000 * cpu / frames if frames else float("nan"),
        "redis_cmds_per_pub": commands / publications if publications else float("nan"),
    }


async def settle(pids: list[int], timeout: float = 60) -> None:
    """Wait until the servers are idle again (a saturated baseline drains its backlog)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = sum(cpu_seconds(p) for p in pids)
        await asyncio.sleep(0.5)
        if sum(cpu_seconds(p) for p in pids) - before < 0.05:
            return
        progress("waiting for the servers to drain")


async def baseline_publisher(layer: Any, interval_ms: int, published: list[int], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time()
    seq = 0
    while not stop.is_set():
        seq += 1
        params = {"channel": "baseline", "data": {"n": seq}, "seq": seq, "ts": int(time.time() * 1000)}
        text = json.dumps({"jsonrpc": "2.0", "method": "message", "params": params})
        await layer.group_send("bench-baseline", {"type": "bench.frame", "text": text})
        published[0] += 1
        deadline += interval_ms / 1000
        await asyncio.sleep(max(0, deadline - loop.time()))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--interval-ms", type=int, default=None)
    parser.add_argument(
        "--server", nargs="+", choices=["daphne", "uvicorn"], default=["daphne"], help="one after the other"
    )
    parser.add_argument(
        "--processes", type=int, default=2, help="hub processes (1: as many as the bare websockets server)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="hub and bare-server windows measured this many times, alternating, for each client count",
    )
    parser.add_argument("--no-channels", action="store_true", help="leave out the plain Channels phase")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="each round's ratios to the bare server, beside the goals")
    parser.add_argument("--daphne-write", nargs="+", choices=["direct", "prepared", "message"], default=None)
    args = parser.parse_args()
    if args.daphne_write and (args.rounds != 1 or args.server != ["daphne"] or args.plot):
        parser.error("--daphne-write compares daphne's write modes in one round: no --rounds, --server or --plot")
    # 1,000 clients connect at once: the process's anonymous handshake rate (200/s, bursts
    # of 400) would refuse some of them on one process; it is admission, not fan-out.
    url, prefix, env = redis_site({"MAX_ANONYMOUS_HANDSHAKES_PER_S": 0})
    os.environ.update(env)
    import django

    django.setup()
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    r = redis.Redis.from_url(url)
    ports = [free_port() for _ in range(args.processes)]
    ref_port = free_port()
    results = []
    if args.daphne_write:
        try:
            results = await compare_writes(args.daphne_write, args, env, r, ports, ref_port)
        finally:
            drop_keys(url, prefix)
        report(results)
        return
    try:
        for name in args.server:
            results += await measure_server(name, args, env, r, layer, ports, ref_port)
    finally:
        drop_keys(url, prefix)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)


async def measure_server(
    name: str,
    args: argparse.Namespace,
    env: dict[str, str],
    r: redis.Redis,
    layer: Any,
    ports: list[int],
    ref_port: int,
) -> list[dict[str, Any]]:
    """Every phase for each client count on ``name``'s processes (rows tagged with it)."""
    results: list[dict[str, Any]] = []
    server = daphne if name == "daphne" else uvicorn
    print(f"== servers: {args.processes} {name} process(es)", file=sys.stderr)
    with processes([server(p) for p in ports], ports, env) as procs:
        pids = [p.pid for p in procs]
        for n in [10, *args.clients]:
            interval = args.interval_ms or (100 if n < 1000 else 1000)
            seconds = args.seconds if n > 10 else min(args.seconds, 5)
            print(f"== {name}: {n} clients, one publication per {interval} ms", file=sys.stderr)
            hub_urls = [f"ws://127.0.0.1:{p}/realtime/" for p in ports]
            channels_urls = [f"ws://127.0.0.1:{p}/baseline/" for p in ports]
            if n <= 10:
                results.append(await run_phase("hub", hub_urls, n, interval, seconds, pids, r))
                if not args.no_channels:
                    results.append(await run_phase("channels", channels_urls, n, interval, seconds, pids, r, layer))
                continue
            ref_cmd = [sys.executable, "bench/ws_broadcast.py", str(ref_port), str(interval)]
            with processes([ref_cmd], [ref_port], {}) as ref:
                ref_url = [f"ws://127.0.0.1:{ref_port}/"]
                for k in range(args.rounds):
                    # Alternate which goes first, so a drift in the machine's load over a
                    # round weighs on both sides alike.
                    order = ["hub", "websockets"] if k % 2 == 0 else ["websockets", "hub"]
                    for kind in order:
                        if kind == "hub":
                            row = await run_phase("hub", hub_urls, n, interval, seconds, pids, r)
                        else:
                            row = await run_phase("websockets", ref_url, n, interval, seconds, [ref[0].pid], r)
                        results.append({**row, "round": k})
            if not args.no_channels:
                # after the rounds: at 1,000 clients plain Channels saturates the machine,
                # and settling after it takes a while
                row = await run_phase("channels", channels_urls, n, interval, seconds, pids, r, layer)
                results.append({**row, "round": 0})
    return [{**row, "server": name} for row in results]


async def compare_writes(
    modes: list[str], args: argparse.Namespace, env: dict[str, str], r: redis.Redis, ports: list[int], ref_port: int
) -> list[dict[str, Any]]:
    """The hub phase on two daphne processes once per write mode, then the bare server."""
    results = []
    for mode in modes:
        print(f"== daphne, frames written {mode}", file=sys.stderr)
        with processes([daphne(p) for p in ports], ports, {**env, "BENCH_DAPHNE_WRITE": mode}) as procs:
            pids = [p.pid for p in procs]
            for n in args.clients:
                interval = args.interval_ms or (100 if n < 1000 else 1000)
                urls = [f"ws://127.0.0.1:{p}/realtime/" for p in ports]
                row = await run_phase("hub", urls, n, interval, args.seconds, pids, r)
                results.append({**row, "kind": f"hub:{mode}"})
    for n in args.clients:
        interval = args.interval_ms or (100 if n < 1000 else 1000)
        ref_cmd = [sys.executable, "bench/ws_broadcast.py", str(ref_port), str(interval)]
        with processes([ref_cmd], [ref_port], {}) as ref:
            url = f"ws://127.0.0.1:{ref_port}/"
            results.append(await run_phase("websockets", [url], n, interval, args.seconds, [ref[0].pid], r))
    return results


def ratios(results: list[dict[str, Any]]) -> dict[tuple[str, int], list[tuple[float, float]]]:
    """Per server and client count, each round's hub / bare server (CPU per frame, p99)."""
    by = {(row.get("server", ""), row["kind"], row["clients"], row.get("round", 0)): row for row in results}
    out: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for (server, kind, n, k), hub in sorted(by.items()):
        ref = by.get((server, "websockets", n, k))
        if kind == "hub" and ref:
            cpu = hub["cpu_s_per_1000"] / ref["cpu_s_per_1000"]
            out.setdefault((server, n), []).append((cpu, hub["p99_ms"] / ref["p99_ms"]))
    return out


def report(results: list[dict[str, Any]]) -> None:
    print(
        f"{'server':<8}{'phase':<11}{'round':>6}{'clients':>8}{'every':>7}{'frames/s':>10}{'of':>8}"
        f"{'p50 ms':>9}{'p99 ms':>9}{'CPU s/1000':>12}{'Redis/pub':>11}"
    )
    for row in results:
        print(
            f"{row.get('server', ''):<8}{row['kind']:<11}{row.get('round', 0) + 1:>6}{row['clients']:>8}"
            f"{row['interval_ms']:>7}{row['frames_per_s']:>10.0f}"
            f"{row['expected_per_s']:>8.0f}{row['p50_ms']:>9.1f}{row['p99_ms']:>9.1f}"
            f"{row['cpu_s_per_1000']:>12.4f}{row['redis_cmds_per_pub']:>11.1f}"
        )
    print()
    by = {(row.get("server", ""), row["kind"], row["clients"], row.get("round", 0)): row for row in results}
    for (server, kind, n, k), row in sorted(by.items()):
        ref = by.get((server, "websockets", n, k))
        if kind.startswith("hub:") and ref:
            print(
                f"n={n}: {kind}/websockets CPU per frame {row['cpu_s_per_1000'] / ref['cpu_s_per_1000']:.2f}, "
                f"p99 {row['p99_ms'] / ref['p99_ms']:.2f}"
            )
        base = by.get((server, "channels", n, k))
        if kind == "hub" and base:
            print(
                f"{server} n={n}: hub/channels CPU per frame {row['cpu_s_per_1000'] / base['cpu_s_per_1000']:.2f}, "
                f"p99 {row['p99_ms'] / base['p99_ms']:.2f}, Redis commands per publication "
                f"{row['redis_cmds_per_pub']:.1f} vs {base['redis_cmds_per_pub']:.1f}"
            )
    for (server, n), pairs in ratios(results).items():
        for k, (cpu, p99) in enumerate(pairs):
            label = f" (round {k + 1})" if len(pairs) > 1 else ""
            print(f"{server} n={n}: hub/websockets CPU per frame {cpu:.2f}, p99 {p99:.2f}{label}")
        if len(pairs) > 1:
            cpus, p99s = [c for c, _ in pairs], [q for _, q in pairs]
            print(
                f"{server} n={n}: hub/websockets over {len(pairs)} rounds, median (range): CPU per frame "
                f"{statistics.median(cpus):.2f} ({min(cpus):.2f}–{max(cpus):.2f}), "
                f"p99 {statistics.median(p99s):.2f} ({min(p99s):.2f}–{max(p99s):.2f})"
            )


GOALS = {"cpu": {100: 2.0, 1000: 1.5}, "p99": 1.25}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Each round's ratio to the bare server as a point, the median as a bar, the goals dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = ratios(results)
    keys = sorted(found, key=lambda key: (key[1], key[0]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, which, title in ((axes[0], 0, "server CPU per delivered frame"), (axes[1], 1, "p99 latency")):
        for x, key in enumerate(keys):
            values = [pair[which] for pair in found[key]]
            ax.bar(x, statistics.median(values), color="#9ecae1", width=0.6)
            ax.scatter([x] * len(values), values, color="#08519c", zorder=3, s=18)
            goal = GOALS["p99"] if which else GOALS["cpu"].get(key[1])
            if goal:
                ax.hlines(goal, x - 0.4, x + 0.4, colors="#d62728", linestyles="dashed")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(keys)), [f"{server}\n{n:,}" for server, n in keys])
        ax.set_xlabel("server, subscribers")
        ax.set_ylabel("hub / bare websockets")
        ax.set_title(title)
    fig.suptitle("fan-out: each round a point, the median a bar, the goal dashed")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    asyncio.run(main())
