"""Memory and idle CPU per connection beside the floor, and how many connections one
hub process holds.

Memory (each server a fresh process, one at a time): the server's RSS with 100 warm
connections, then with N; the difference over N − 100 is the cost of one connection.

* ``hub``: daphne with realtime_app on Redis; each connection subscribes to ``demo:events``
  (an event channel, idle here);
* ``uvicorn``: the same site under uvicorn (``--ws websockets-sansio``);
* ``channels``: daphne, ``/baseline/``: a plain ``AsyncWebsocketConsumer`` that joins a
  group at connect;
* ``websockets``: a bare ``websockets`` server holding the connections, the floor.

Idle CPU (``--idle N``): hub, uvicorn and the floor each hold N connections whose clients
answer the server's pings (every ``--ping-interval`` s, the same for all three), over two
heartbeat rounds: CPU per 1,000 connections and its ratio to the floor's.

Then one hub process (daphne; ``--hold-kinds hub uvicorn``: under each in turn) holds each
``--hold`` count of idle subscribed connections with the same heartbeat: its CPU while
idle, the CPU of a ``/realtime/metrics`` read, then ten publications on ``demo:events`` and
their fan-out latency (receive time − the publication's ``ts``), over every connection and
over 20 connections of a process of their own, at arbitrary places in the fan-out order
(what this process adds reading 10,000 sockets on a 2-core machine is then not in their
figure).

Usage:  REDIS_URL=redis://127.0.0.1:6379/0 python bench/connections.py [--sizes 1000 5000]
            [--idle 10000] [--hold 500 20000] [--hold-kinds hub uvicorn] [--ping-interval 20]
            [--json FILE]
The file-descriptor limit of this process (inherited by the servers and the probe
process) is raised to what the largest count needs plus 300: the soft limit up to the
hard one, and the hard one too when the script may (root, or CAP_SYS_RESOURCE; up to
``fs.nr_open``, 1,048,576 here); otherwise it says what to raise. The handshake limits
(``MAX_CONNECTIONS``, anonymous handshakes per second) are off here: opening the sockets is
not what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import resource
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis
import websockets

from bench.common import (
    cpu_seconds,
    daphne,
    free_port,
    open_ws,
    percentile,
    processes,
    progress,
    settled_rss,
    uvicorn,
)

WARM = 100
PROBES = 20  # connections of the probe process
PUBLICATIONS = 10


async def open_connections(url: str, count: int, subscribe: str | None, into: list[Any], receive: bool = False) -> None:
    """Open ``count`` more connections to ``url`` (50 at a time), subscribed when asked."""
    sem = asyncio.Semaphore(50)
    start = len(into)

    async def one(i: int) -> None:
        async with sem:
            ws = await open_ws(
                url,
                # one source address has 28,000 ports to a server's port: past 20,000
                # sockets, from 127.0.0.1, .2, .3 and .4 in turn
                local_addr=(f"127.0.0.{1 + (start + i) % 4}", 0) if start + count > 20_000 else None,
            )
            if subscribe:
                await ws.send(
                    json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": subscribe}, "id": 1})
                )
                answer = json.loads(await ws.recv())
                if "result" not in answer:
                    raise RuntimeError(f"subscribe refused: {answer}")
            into.append(ws)

    target = len(into) + count
    tasks = [asyncio.create_task(one(i)) for i in range(count)]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(1)
        progress(f"{len(into)}/{target} connections")
    for t in tasks:
        t.result()


async def close_all(sockets: list[Any]) -> None:
    sem = asyncio.Semaphore(200)

    async def one(ws: Any) -> None:
        async with sem:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), 5)

    await asyncio.gather(*(one(ws) for ws in sockets))
    sockets.clear()


PACKAGES = ("twisted", "autobahn", "daphne", "channels", "django", "realtime_app", "asyncio", "websockets")


def package_of(filename: str) -> str:
    parts = Path(filename).parts
    for name in PACKAGES:
        if name in parts:
            return name
    return "other"


async def snapshot(pid: int, stem: str) -> Any:
    """The server's tracemalloc snapshot (bench/asgi.py dumps one on SIGUSR1)."""
    import tracemalloc

    before = set(Path(stem).parent.glob(Path(stem).name + ".*"))
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = set(Path(stem).parent.glob(Path(stem).name + ".*")) - before
        if new:
            path = new.pop()
            await asyncio.sleep(1)  # let the dump finish writing
            return tracemalloc.Snapshot.load(str(path))
        await asyncio.sleep(0.2)
    raise RuntimeError("no tracemalloc snapshot from the server")


def where(before: Any, after: Any, n: int) -> dict[str, float]:
    """Python bytes per connection by package: the snapshots' difference over ``n``."""
    sizes: dict[str, float] = {}
    for stat in after.compare_to(before, "filename"):
        package = package_of(stat.traceback[0].filename)
        sizes[package] = sizes.get(package, 0.0) + stat.size_diff / n
    return dict(sorted(sizes.items(), key=lambda item: -item[1]))


async def where_phase(n: int, env: dict[str, str]) -> dict[str, float]:
    """Where the hub's bytes per connection go, by package (tracemalloc in the server):
    snapshots with ``WARM`` connections and with ``n`` more."""
    import tempfile

    port = free_port()
    url = f"ws://127.0.0.1:{port}/realtime/"
    sockets: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        stem = f"{tmp}/snap"
        with processes([daphne(port)], [port], {**env, "BENCH_TRACEMALLOC": stem}) as procs:
            pid = procs[0].pid
            await open_connections(url, WARM, "demo:events", sockets)
            await settled_rss(pid)
            before = await snapshot(pid, stem)
            await open_connections(url, n, "demo:events", sockets)
            await settled_rss(pid)
            after = await snapshot(pid, stem)
            await close_all(sockets)
    return where(before, after, n)


def server_command(kind: str, port: int, ping_interval: int | None = None) -> tuple[list[str], str, str | None]:
    """The server of ``kind``, its WebSocket path and the channel its clients subscribe to."""
    if kind == "websockets":
        command = [sys.executable, "bench/ws_broadcast.py", str(port), "3600000"]
        if ping_interval is not None:
            command.append(str(ping_interval))
        return command, "/", None
    if kind == "uvicorn":
        command = uvicorn(port)
        if ping_interval is not None:
            command += ["--ws-ping-interval", str(ping_interval), "--ws-ping-timeout", str(3 * ping_interval)]
        return command, "/realtime/", "demo:events"
    command = daphne(port)
    if ping_interval is not None:
        command += ["--ping-interval", str(ping_interval), "--ping-timeout", str(3 * ping_interval)]
    return (command, "/realtime/", "demo:events") if kind == "hub" else (command, "/baseline/", None)


async def memory_phase(kind: str, n: int, env: dict[str, str]) -> dict[str, Any]:
    port = free_port()
    command, path, channel = server_command(kind, port)
    url = f"ws://127.0.0.1:{port}{path}"
    sockets: list[Any] = []
    with processes([command], [port], env) as procs:
        pid = procs[0].pid
        await open_connections(url, WARM, channel, sockets)
        base = await settled_rss(pid)
        await open_connections(url, n - WARM, channel, sockets)
        full = await settled_rss(pid)
        await close_all(sockets)
    gc.collect()
    per = (full - base) / (n - WARM)
    progress(f"{kind} n={n}: RSS {base / 2**20:.1f} MiB -> {full / 2**20:.1f} MiB, {per / 1024:.1f} KiB each")
    return {"kind": kind, "connections": n, "rss_warm": base, "rss_full": full, "bytes_per_connection": per}


async def idle_phase(kind: str, n: int, ping_interval: int, env: dict[str, str]) -> dict[str, Any]:
    """CPU of one server holding ``n`` idle connections (subscribed, for the hub) whose
    clients answer its pings, over two heartbeat rounds; its RSS then."""
    port = free_port()
    command, path, channel = server_command(kind, port, ping_interval)
    url = f"ws://127.0.0.1:{port}{path}"
    sockets: list[Any] = []
    with processes([command], [port], env) as procs:
        pid = procs[0].pid
        await open_connections(url, n, channel, sockets)
        readers = [asyncio.create_task(drain_frames(ws)) for ws in sockets]  # reading answers the pings
        rss = await settled_rss(pid)
        share, still = await idle_cpu(pid, sockets, ping_interval, f"{kind}: {n} connections")
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await close_all(sockets)
    progress(f"{kind}: {100 * share:.2f}% of a core, {100 * share / n * 1000:.3f}% per 1,000; {still}/{n} open")
    return {
        "kind": kind,
        "connections": n,
        "ping_interval_s": ping_interval,
        "cpu_share": share,
        "rss": rss,
        "open": still,
    }


async def idle_cpu(pid: int, sockets: list[Any], ping_interval: int, what: str) -> tuple[float, int]:
    """The server's share of a core over two heartbeat rounds of idle connections, and how
    many of ``sockets`` are still open after."""
    idle_s = max(2.0 * ping_interval, 10.0)
    progress(f"{what} idle for {idle_s:.0f} s (two heartbeat rounds)")
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(idle_s)
    share = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
    return share, sum(1 for ws in sockets if ws.state is websockets.protocol.State.OPEN)


async def drain_frames(ws: Any) -> None:
    with contextlib.suppress(websockets.ConnectionClosed, asyncio.CancelledError):
        async for _ in ws:
            pass


async def probe_cost(pid: int, port: int, env: dict[str, str], rounds: int = 7, reads: int = 100) -> tuple[int, float]:
    """The process's probe at this many connections: its size as it publishes it (the
    Redis key the cluster view reads), and the server's CPU per ``/realtime/metrics`` read
    (the probe, the cluster's, the Prometheus text, the HTTP request), read as a Prometheus
    server reads it: over one kept-alive connection. Heartbeats keep a process holding
    thousands of sockets busy in bursts, so each round of ``reads`` back to back sits
    between two idle windows of its own, and what the process spent in them, per second,
    is taken from the round's; the median round is the figure."""
    import http.client
    import statistics

    r = redis.Redis.from_url(env["REDIS_URL"])
    keys = list(r.scan_iter(match=f"{env['REALTIME_KEY_PREFIX']}:probe:*"))
    size = max((int(r.strlen(key)) for key in keys), default=0)
    headers = {"Authorization": f"Bearer {env['REALTIME_METRICS_TOKEN']}"}

    def measure() -> list[float]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

        def read() -> None:
            connection.request("GET", "/realtime/metrics", headers=headers)
            response = connection.getresponse()
            response.read()
            if response.status != 200:
                raise RuntimeError(f"/realtime/metrics answered {response.status}")

        read()
        window = 3.0
        marks = [(cpu_seconds(pid), time.monotonic())]
        for _ in range(rounds):
            time.sleep(window)
            marks.append((cpu_seconds(pid), time.monotonic()))
            for _ in range(reads):
                read()
            marks.append((cpu_seconds(pid), time.monotonic()))
        time.sleep(window)
        marks.append((cpu_seconds(pid), time.monotonic()))
        connection.close()
        per_read = []
        for i in range(rounds):
            (c0, t0), (c1, t1), (c2, t2), (c3, t3) = marks[2 * i : 2 * i + 4]
            idle = ((c1 - c0) + (c3 - c2)) / ((t1 - t0) + (t3 - t2))
            per_read.append(1000 * max(0.0, (c2 - c1) - idle * (t2 - t1)) / reads)
        return per_read

    per_read = await asyncio.to_thread(measure)
    progress("CPU per /realtime/metrics read, by round: " + ", ".join(f"{ms:.2f}" for ms in per_read) + " ms")
    return size, statistics.median(per_read)


SERVERS = {"hub": "daphne", "uvicorn": "uvicorn"}


async def hold_phase(n: int, ping_interval: int, env: dict[str, str], kind: str = "hub") -> dict[str, Any]:
    """One hub process (``hub``: daphne, or ``uvicorn``), ``n`` subscribed connections,
    heartbeats on; idle CPU, then the fan-out latency of ten publications."""
    from realtime_app import apublish

    port = free_port()
    command, path, _ = server_command(kind, port, ping_interval)
    url = f"ws://127.0.0.1:{port}{path}"
    sockets: list[Any] = []
    latencies: list[float] = []
    received = [0]
    with processes([command], [port], env) as procs:
        pid = procs[0].pid
        await open_connections(url, n, "demo:events", sockets)
        # Every client answers the server's pings (websockets does on read) and notes frames.
        recording = asyncio.Event()

        async def reader(ws: Any) -> None:
            with contextlib.suppress(websockets.ConnectionClosed, asyncio.CancelledError):
                async for text in ws:
                    message = json.loads(text)
                    params = message.get("params") or {}
                    if recording.is_set() and message.get("method") == "message":
                        received[0] += 1
                        latencies.append(time.time() * 1000 - params["ts"])

        readers = [asyncio.create_task(reader(ws)) for ws in sockets]
        # A few connections in a process of their own: their latency is the server's
        # fan-out, not this process's work reading 10,000 sockets.
        probe = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--probe",
            url,
            str(PROBES),
            str(PUBLICATIONS),
            stdout=asyncio.subprocess.PIPE,
        )
        assert probe.stdout is not None
        if (await probe.stdout.readline()).strip() != b"ready":
            raise RuntimeError("the probe process did not connect")
        rss = await settled_rss(pid)
        idle_share, open_after_idle = await idle_cpu(pid, sockets, ping_interval, f"holding {n} connections")
        probe_bytes, probe_cpu_ms = await probe_cost(pid, port, env)
        recording.set()
        publications = PUBLICATIONS
        for i in range(publications):
            await apublish("demo:events", {"n": i})
            await asyncio.sleep(1.0)
        deadline = time.monotonic() + 30
        while received[0] < publications * n and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            progress(f"{received[0]}/{publications * n} frames received")
        probed = json.loads(await asyncio.wait_for(probe.stdout.read(), 60))
        await probe.wait()
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        await close_all(sockets)
    row = {
        "kind": kind,
        "connections": n,
        "ping_interval_s": ping_interval,
        "rss": rss,
        "idle_cpu_share": idle_share,
        "open_after_idle": open_after_idle,
        "frames": received[0],
        "expected": publications * n,
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies, default=float("nan")),
        "probe_bytes": probe_bytes,
        "probe_cpu_ms": probe_cpu_ms,
        "probe_frames": len(probed),
        "probe_p50_ms": percentile(probed, 50),
        "probe_p99_ms": percentile(probed, 99),
    }
    return row


async def probe_main(url: str, count: int, messages: int) -> None:
    """``--probe``: ``count`` subscribed connections; "ready", then the latencies of the
    next ``messages`` publications on each, as one JSON list."""
    sockets: list[Any] = []
    await open_connections(url, count, "demo:events", sockets)
    print("ready", flush=True)
    latencies: list[float] = []

    async def reader(ws: Any) -> None:
        seen = 0
        while seen < messages:
            message = json.loads(await ws.recv())
            if message.get("method") == "message":
                seen += 1
                latencies.append(time.time() * 1000 - message["params"]["ts"])

    with contextlib.suppress(TimeoutError):  # the idle phase and the probe's reads come first
        await asyncio.wait_for(asyncio.gather(*(reader(ws) for ws in sockets)), 600)
    print(json.dumps(latencies), flush=True)
    await close_all(sockets)


def raise_file_limit(needed: int) -> int:
    """Raise this process's file-descriptor limit (inherited by the servers) to ``needed``
    at least: the soft limit up to the hard one, the hard one too where allowed (root, or
    CAP_SYS_RESOURCE; up to ``fs.nr_open``). Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, needed))
            return needed
        sys.exit(f"the file-descriptor limit is {hard}: raise it (ulimit -Hn, or run as root) or ask for fewer")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return int(hard)


async def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--probe":
        await probe_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--hold", type=int, nargs="*", default=[10000], help="one process holding each many")
    parser.add_argument(
        "--hold-kinds", nargs="+", choices=["hub", "uvicorn"], default=["hub"], help="the hub under daphne, uvicorn"
    )
    parser.add_argument("--ping-interval", type=int, default=20)
    parser.add_argument("--idle", type=int, default=2000, help="idle CPU beside the floor at this many (0: skip)")
    parser.add_argument(
        "--kinds", nargs="+", default=["hub", "uvicorn", "channels", "websockets"], help="servers of the memory phase"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    url = os.environ.get("REDIS_URL")
    if not url:
        sys.exit("set REDIS_URL (e.g. redis://127.0.0.1:6379/0)")
    limit = raise_file_limit(max([*args.sizes, *args.hold, args.idle]) + 300)
    print(f"file-descriptor limit of this process and its servers: {limit}", file=sys.stderr)
    prefix = f"bench-{secrets.token_hex(3)}"
    env = {
        "REDIS_URL": url,
        "REALTIME_KEY_PREFIX": prefix,
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "REALTIME_METRICS_TOKEN": secrets.token_hex(8),
        # the handshake limits (anonymous handshakes per second, the process's ceiling) would
        # only slow the opening of thousands of sockets here: what is measured is holding them
        "REALTIME_BENCH_OVERRIDES": json.dumps(
            {
                "MAX_CONNECTIONS": 0,
                "MAX_ANONYMOUS_HANDSHAKES_PER_S": 0,
                "HANDSHAKES_PER_S": 0,
                # past 20,000 sockets they come from 127.0.0.1-4, each saying its client
                "TRUSTED_PROXIES": ["127.0.0.0/8"],
            }
        ),
    }
    os.environ.update(env)
    import django

    django.setup()
    r = redis.Redis.from_url(url)
    memory: list[dict[str, Any]] = []
    idle: list[dict[str, Any]] = []
    holds: list[dict[str, Any]] = []
    breakdown: dict[str, float] = {}
    try:
        for n in args.sizes:
            print(f"== memory, {n} idle connections", file=sys.stderr)
            for kind in args.kinds:
                memory.append(await memory_phase(kind, n, env))
        if args.idle:
            print(f"== idle CPU, {args.idle} connections, heartbeat every {args.ping_interval} s", file=sys.stderr)
            for kind in ("hub", "uvicorn", "websockets"):
                idle.append(await idle_phase(kind, args.idle, args.ping_interval, env))
        print(f"== where the hub's bytes go, {args.sizes[0]} connections (tracemalloc)", file=sys.stderr)
        breakdown = await where_phase(args.sizes[0], env)
        for kind in args.hold_kinds:
            for n in args.hold:
                print(f"== one {SERVERS[kind]} process, {n} subscribed connections", file=sys.stderr)
                holds.append(await hold_phase(n, args.ping_interval, env, kind))
    finally:
        from realtime_app.hub import running_hub

        hub = running_hub()
        if hub is not None:
            await hub.aclose()
        for key in r.scan_iter(match=f"{prefix}*"):
            r.delete(key)
    report(memory, breakdown, holds, idle)
    if args.json:
        args.json.write_text(
            json.dumps({"memory": memory, "idle": idle, "python_bytes_by_package": breakdown, "hold": holds}, indent=2)
        )


def report(
    memory: list[dict[str, Any]], breakdown: dict[str, float], holds: list[dict[str, Any]], idle: list[dict[str, Any]]
) -> None:
    print(f"{'server':<11}{'connections':>12}{'RSS warm MiB':>14}{'RSS full MiB':>14}{'KiB/conn':>10}")
    for row in memory:
        print(
            f"{row['kind']:<11}{row['connections']:>12}{row['rss_warm'] / 2**20:>14.1f}"
            f"{row['rss_full'] / 2**20:>14.1f}{row['bytes_per_connection'] / 1024:>10.1f}"
        )
    by = {(row["kind"], row["connections"]): row["bytes_per_connection"] for row in memory}
    for n in sorted({row["connections"] for row in memory}):
        floor = by.get(("websockets", n))
        ratios = [
            f"{kind}/websockets {by[kind, n] / floor:.2f}"
            for kind in ("hub", "uvicorn", "channels")
            if floor and (kind, n) in by
        ]
        if ratios:
            print(f"n={n}: memory per connection " + ", ".join(ratios))
    if idle:
        print(
            f"\n{'server':<11}{'connections':>12}{'heartbeat s':>12}{'% of a core':>12}{'per 1,000':>10}{'vs floor':>9}"
        )
        floor_cpu = next((row["cpu_share"] for row in idle if row["kind"] == "websockets"), 0.0)
        for row in idle:
            ratio = row["cpu_share"] / floor_cpu if floor_cpu else float("nan")
            print(
                f"{row['kind']:<11}{row['connections']:>12}{row['ping_interval_s']:>12}"
                f"{100 * row['cpu_share']:>12.2f}{100 * row['cpu_share'] / row['connections'] * 1000:>10.3f}"
                f"{ratio:>9.2f}"
            )
    if breakdown:
        total = sum(breakdown.values())
        parts = ", ".join(f"{name} {size / 1024:.1f}" for name, size in breakdown.items() if abs(size) >= 100)
        print(f"\nPython heap per hub connection (tracemalloc): {total / 1024:.1f} KiB: {parts} (KiB)")
    for hold in holds:
        print(
            f"\none {SERVERS[hold.get('kind', 'hub')]} process, {hold['connections']} subscribed connections, "
            f"heartbeat every "
            f"{hold['ping_interval_s']} s: RSS {hold['rss'] / 2**20:.0f} MiB, idle CPU "
            f"{100 * hold['idle_cpu_share']:.1f}% of a core, {hold['open_after_idle']} still open; "
            f"10 publications: {hold['frames']}/{hold['expected']} frames, "
            f"fan-out over every connection (read by this process) p50 {hold['p50_ms']:.0f} ms, "
            f"p99 {hold['p99_ms']:.0f} ms, max {hold['max_ms']:.0f} ms; to the {PROBES} connections of a "
            f"process of their own: p50 {hold['probe_p50_ms']:.0f} ms, "
            f"p99 {hold['probe_p99_ms']:.0f} ms ({hold['probe_frames']} frames); its probe "
            f"{hold['probe_bytes'] / 1024:.1f} KiB, {hold['probe_cpu_ms']:.1f} ms of CPU per probe read"
        )


if __name__ == "__main__":
    asyncio.run(main())
