"""Server-Sent Events beside the WebSocket path: CPU per delivered event and memory per
idle connection, side by side in one run, one server process of the demo site.

* **CPU per event** (one server, phases alternated: websocket, sse, websocket, sse): N
  clients on ``demo:clock:<ms>`` (one ticker, every client gets every tick) for
  ``--seconds``; the server's CPU seconds per 1,000 delivered frames, and p50/p99 latency
  (receive time − the publication's ``ts``). The WebSocket clients subscribe over
  ``/realtime/``; the SSE clients read ``GET /realtime/sse?channel=…`` (raw HTTP/1.1 readers,
  counting events).
* **Memory per idle connection** (a fresh server per transport): the server's RSS with 100
  warm connections, then with ``--idle`` more, each subscribed to ``demo:events`` (quiet):
  the difference over the count.

Goal (docs/sse.md): an SSE event costs ≤ 1.5× a WebSocket frame's CPU.

Usage:  python bench/sse.py [--clients 200] [--seconds 10] [--interval-ms 100]
            [--idle 2000] [--server daphne|uvicorn] [--json FILE] [--plot PNG]
No Redis: one process on the in-memory layer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import websockets

from bench.common import (
    Collector,
    as_new_client,
    cpu_seconds,
    daphne,
    free_port,
    percentile,
    prepare_database,
    processes,
    progress,
    settled_rss,
    uvicorn,
)

WARM = 100


class SseReader:
    """One ``GET /realtime/sse`` read raw: events counted into a collector."""

    def __init__(self, port: int, channel: str, collector: Collector | None) -> None:
        self.port, self.channel, self.collector = port, channel, collector
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        forwarded = as_new_client()["X-Forwarded-For"]
        request = (
            f"GET /realtime/sse?channel={self.channel} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Accept: text/event-stream\r\nX-Forwarded-For: {forwarded}\r\n\r\n"
        )
        self.writer.write(request.encode())
        head = await reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"stream refused: {head[:200]!r}")
        self.task = asyncio.get_running_loop().create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        pending = b""
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                if self.collector is None:
                    continue
                pending += data
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    at = event.find(b"\ndata: ")
                    if at != -1 and event.find(b"event: realtime.") == -1:
                        self.collector.note(
                            b'{"method":"message","params":' + event[at + 7 :].split(b"\r\n", 1)[0] + b"}"
                        )

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        if self.writer is not None:
            self.writer.close()


async def open_ws(port: int, channel: str, collector: Collector | None) -> Any:
    ws = await websockets.connect(
        f"ws://127.0.0.1:{port}/realtime/",
        origin="http://127.0.0.1",
        open_timeout=120,
        ping_interval=None,
        compression=None,
        max_size=None,
        additional_headers=as_new_client(),
    )
    await ws.send(json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": channel}, "id": 1}))
    answer = json.loads(await ws.recv())
    if "result" not in answer:
        raise RuntimeError(f"subscribe refused: {answer}")

    async def read() -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for text in ws:
                if collector is not None:
                    collector.note(text)

    ws.reader = asyncio.get_running_loop().create_task(read())  # type: ignore[attr-defined]
    return ws


async def close_ws(ws: Any) -> None:
    ws.reader.cancel()
    await asyncio.gather(ws.reader, return_exceptions=True)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(), 5)


async def open_many(kind: str, port: int, channel: str, count: int, collector: Collector | None) -> list[Any]:
    sem = asyncio.Semaphore(50)

    async def one() -> Any:
        async with sem:
            if kind == "websocket":
                return await open_ws(port, channel, collector)
            stream = SseReader(port, channel, collector)
            await stream.open()
            return stream

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def close_many(kind: str, conns: list[Any]) -> None:
    await asyncio.gather(*((close_ws(c) if kind == "websocket" else c.close()) for c in conns))


async def cpu_phase(kind: str, port: int, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    collector = Collector()
    channel = f"demo:clock:{args.interval_ms}"
    conns = await open_many(kind, port, channel, args.clients, collector)
    await asyncio.sleep(2)  # every client past its first frames
    collector.recording = True
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(args.seconds)
    cpu = cpu_seconds(pid) - cpu0
    wall = time.monotonic() - t0
    collector.recording = False
    await close_many(kind, conns)
    frames = collector.frames
    result = {
        "kind": kind,
        "clients": args.clients,
        "frames": frames,
        "frames_per_s": frames / wall,
        "cpu_per_1000": 1000 * cpu / max(frames, 1),
        "p50_ms": percentile(collector.latencies, 50),
        "p99_ms": percentile(collector.latencies, 99),
    }
    progress(
        f"{kind}: {frames} frames, {result['cpu_per_1000']:.4f} CPU s per 1,000, "
        f"p50 {result['p50_ms']:.1f} ms, p99 {result['p99_ms']:.1f} ms"
    )
    return result


async def memory_phase(kind: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    port = free_port()
    command = daphne(port) if args.server == "daphne" else uvicorn(port)
    with processes([command], [port], env) as procs:
        pid = procs[0].pid
        conns = await open_many(kind, port, "demo:events", WARM, None)
        base = await settled_rss(pid)
        progress(f"{kind}: {WARM} warm connections, RSS {base / 2**20:.1f} MiB; opening {args.idle} more")
        conns += await open_many(kind, port, "demo:events", args.idle, None)
        full = await settled_rss(pid)
        await close_many(kind, conns)
    per = (full - base) / args.idle
    progress(f"{kind}: RSS {full / 2**20:.1f} MiB with {WARM + args.idle}: {per / 1024:.1f} KiB each")
    return {
        "kind": kind,
        "connections": WARM + args.idle,
        "rss_warm": base,
        "rss_full": full,
        "bytes_per_connection": per,
    }


def report(cpu: list[dict[str, Any]], memory: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    def mean(kind: str, key: str) -> float:
        values = [r[key] for r in cpu if r["kind"] == kind]
        return sum(values) / len(values)

    ws_cpu, sse_cpu = mean("websocket", "cpu_per_1000"), mean("sse", "cpu_per_1000")
    by_kind = {m["kind"]: m for m in memory}
    summary = {
        "server": args.server,
        "clients": args.clients,
        "interval_ms": args.interval_ms,
        "cpu_per_1000_websocket": ws_cpu,
        "cpu_per_1000_sse": sse_cpu,
        "cpu_ratio": sse_cpu / ws_cpu,
        "p99_ratio": mean("sse", "p99_ms") / mean("websocket", "p99_ms"),
        "kib_per_idle_websocket": by_kind["websocket"]["bytes_per_connection"] / 1024,
        "kib_per_idle_sse": by_kind["sse"]["bytes_per_connection"] / 1024,
    }
    print(f"\nSSE vs WebSocket under {args.server}, {args.clients} clients at {args.interval_ms} ms:")
    print(f"{'phase':<10} {'frames/s':>9} {'CPU s/1000':>11} {'p50 ms':>7} {'p99 ms':>7}")
    for r in cpu:
        line = f"{r['kind']:<10} {r['frames_per_s']:>9.0f} {r['cpu_per_1000']:>11.4f}"
        print(f"{line} {r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f}")
    print(
        f"CPU per event: SSE {summary['cpu_ratio']:.2f}× the WebSocket's (goal ≤ 1.5×); p99 {summary['p99_ratio']:.2f}×"
    )
    print(
        f"memory per idle connection: WebSocket {summary['kib_per_idle_websocket']:.1f} KiB, "
        f"SSE {summary['kib_per_idle_sse']:.1f} KiB ({args.idle} connections)"
    )
    return summary


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    """CPU per 1,000 events and memory per idle connection, WebSocket beside SSE, per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cpu_ax, mem_ax) = plt.subplots(1, 2, figsize=(8, 3.6))
    servers = [s["server"] for s in summaries]
    xs = range(len(servers))
    width = 0.38
    for offset, kind, colour in ((-width / 2, "websocket", "tab:blue"), (width / 2, "sse", "tab:orange")):
        cpu_ax.bar([x + offset for x in xs], [s[f"cpu_per_1000_{kind}"] for s in summaries], width, color=colour)
        mem_ax.bar([x + offset for x in xs], [s[f"kib_per_idle_{kind}"] for s in summaries], width, color=colour)
    for ax, title in ((cpu_ax, "server CPU s per 1,000 events"), (mem_ax, "KiB per idle connection")):
        ax.set_xticks(list(xs), servers)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    cpu_ax.legend(["WebSocket", "SSE"], loc="lower left")
    fig.suptitle(f"SSE beside WebSocket: {summaries[0]['clients']} clients at {summaries[0]['interval_ms']} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--interval-ms", type=int, default=100)
    parser.add_argument("--idle", type=int, default=2000)
    parser.add_argument("--server", choices=("daphne", "uvicorn"), nargs="+", default=["daphne"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * (args.idle + WARM) + 300
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    database = prepare_database(str(Path(tempfile.mkdtemp(prefix="bench-sse-")) / "db.sqlite3"))
    env = {
        **database,
        "REDIS_URL": "",
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "REALTIME_METRICS_TOKEN": secrets.token_hex(8),
        "REALTIME_BENCH_OVERRIDES": json.dumps(
            {"MAX_CONNECTIONS": 0, "MAX_ANONYMOUS_HANDSHAKES_PER_S": 0, "HANDSHAKES_PER_S": 0}
        ),
    }
    os.environ.update(env)
    runs = []
    for server in args.server:
        args_one = argparse.Namespace(**{**vars(args), "server": server})
        cpu: list[dict[str, Any]] = []
        port = free_port()
        command = daphne(port) if server == "daphne" else uvicorn(port)
        with processes([command], [port], env) as procs:
            for kind in ("websocket", "sse", "websocket", "sse"):
                progress(f"{server}, {kind}: {args.clients} clients for {args.seconds:.0f} s")
                cpu.append(await cpu_phase(kind, port, procs[0].pid, args_one))
        memory = [await memory_phase(kind, args_one, env) for kind in ("websocket", "sse")]
        runs.append({"summary": report(cpu, memory, args_one), "cpu": cpu, "memory": memory})
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    if args.plot:
        plot([run["summary"] for run in runs], args.plot)


if __name__ == "__main__":
    asyncio.run(main())
