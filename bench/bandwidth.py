"""Bytes per update and what they cost: full frames, deltas and permessage-deflate; and
the staleness of a slow reader under ``drop`` and ``conflate``. One run, side by side.

1. **codec** — the feed (a dashboard state of 40 fields, about 2.3 KiB of JSON, three
   fields changed per publication) through the server's own code
   (:class:`realtime_app.wire.deltas.ChannelDeltas`) and a client's (``apply_delta``):
   bytes per update, the delta's CPU once per publication, a client's CPU to apply one.
2. **live** — the same feed from a ticker of the bench site (``bench:dash``) on one
   uvicorn process (``--ws websockets-sansio``), N subscribers on one machine, three
   phases on fresh processes: ``full`` (plain subscriptions, no compression), ``delta``
   (``"delta": "fossil"``), ``deflate`` (plain subscriptions, permessage-deflate
   negotiated: uvicorn compresses each frame for each connection, with context takeover)
   and ``delta+deflate``. Measured over a window: bytes the server wrote to its sockets
   (``/proc/PID/io`` ``wchar``: frames, headers, compression all included) and server CPU,
   each per delivered update, and the server's memory per connection; 10 updates a second
   at 100 subscribers, 2 a second at 1,000 (one client process must keep up).
3. **staleness** — state channels of 16 KiB frames, at 10 Hz steadily or in bursts (1.5 s of
   every 3.1 s: a dashboard whose figures change in spells), readers that read once every
   2.5 s (all that is there, then whatever comes until 60 ms pass without a frame: one of
   the hub's drains of held frames, 50 ms, and less than a publication interval), one on
   a ``conflate`` channel, one on a ``drop`` one of each feed (threshold 64 KiB), and a reference
   reader: after each read, how far behind the newest publication the value each reader
   holds is (ms of publication time), and the same every 50 ms for the plot.

Usage:  python bench/bandwidth.py [--only codec live staleness] [--subscribers 100 1000]
            [--seconds 8] [--reads 12] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import resource
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import as_new_client, cpu_seconds, free_port, processes, progress, rss_bytes, uvicorn
from realtime_app.wire.deltas import ChannelDeltas
from realtime_app.wire.fossil import apply_delta
from realtime_app.wire.protocol import notification_text


def feed(publications: int, seed: int = 1):
    rng = random.Random(seed)
    state = {f"field_{i}": {"value": round(i * 1.5, 2), "label": f"sensor {i}", "ok": True} for i in range(40)}
    for seq in range(1, publications + 1):
        for k in rng.sample(range(40), 3):
            state[f"field_{k}"]["value"] = round(state[f"field_{k}"]["value"] + rng.uniform(-1, 1), 2)
        yield (
            seq,
            notification_text("dash:board", json.dumps(state, separators=(",", ":")), seq, 1_796_000_000_000 + seq),
        )


def codec(args: argparse.Namespace) -> dict[str, Any]:
    deltas = ChannelDeltas()
    plain, sent, build, apply_cost = [], [], [], []
    base = b""
    for seq, text in feed(args.publications):
        plain.append(len(text.encode()))
        started = time.process_time()
        frames = deltas.frames("dash:board", text, seq)
        build.append(time.process_time() - started)
        if frames.delta is None:
            sent.append(len(frames.full.encode()))
            base = json.loads(frames.full)["params"]["data"].encode()
            continue
        sent.append(len(frames.delta.encode()))
        data = json.loads(frames.delta)["params"]["data"].encode("latin-1")
        started = time.process_time()
        base = apply_delta(base, data)
        apply_cost.append(time.process_time() - started)
        assert json.loads(base) == json.loads(text)["params"]["data"]  # rebuilt exactly
    per_update_plain, per_update_delta = statistics.mean(plain), statistics.mean(sent)
    build_us = 1e6 * statistics.mean(build)
    print(f"codec: {args.publications} publications of a {plain[0] / 1024:.1f} KiB state, 3 of 40 fields changed each")
    print(
        f"  bytes per update: plain frames {per_update_plain:.0f} B, delta subscription {per_update_delta:.0f} B "
        f"(fulls included): {per_update_plain / per_update_delta:.1f}x fewer"
    )
    print(f"  server, once per publication: the delta {build_us:.0f} us (CPU)")
    print(f"  client, per delta frame: apply {1e6 * statistics.median(apply_cost):.0f} us (median)")
    return {"plain_bytes": per_update_plain, "delta_bytes": per_update_delta, "build_us": build_us}


def written_bytes(pid: int) -> int:
    """Bytes the process passed to write/send calls so far (sockets included)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/PID/io")


async def subscriber(
    url: str, channel: str, mode: str, counts: list[int], ready: list[int], stop: asyncio.Event
) -> None:
    import websockets

    async with websockets.connect(
        url,
        origin="http://127.0.0.1",
        additional_headers=as_new_client(),
        max_size=None,
        open_timeout=60,
        ping_interval=None,
        compression="deflate" if "deflate" in mode else None,
    ) as ws:
        params: dict[str, Any] = {"channel": channel, **({"delta": "fossil"} if "delta" in mode else {})}
        await ws.send(json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": params, "id": 1}))
        ready[0] += 1
        with contextlib.suppress(websockets.ConnectionClosed):
            while not stop.is_set():
                await ws.recv()
                counts[0] += 1


#: The live phases: plain frames, deltas, per-message compression, and both together.
MODES = ("full", "delta", "deflate", "delta+deflate")


async def live_phase(mode: str, n: int, seconds: float) -> dict[str, Any]:
    port = free_port()
    env = {"REDIS_URL": "", "DJANGO_SETTINGS_MODULE": "bench.settings"}
    interval = 100 if n <= 100 else 500
    channel = f"bench:dash:{interval}"
    with processes([uvicorn(port, deflate="deflate" in mode)], [port], env) as [server]:
        rss0 = rss_bytes(server.pid)
        url = f"ws://127.0.0.1:{port}/realtime/"
        counts, ready, stop = [0], [0], asyncio.Event()
        tasks = []
        for _ in range(n):
            tasks.append(asyncio.create_task(subscriber(url, channel, mode, counts, ready, stop)))
            await asyncio.sleep(0.002)  # within the handshake limits
        deadline = time.monotonic() + 60
        while ready[0] < n and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(2)  # every subscriber has had its first (full) frame
        frames0, cpu0, bytes0 = counts[0], cpu_seconds(server.pid), written_bytes(server.pid)
        await asyncio.sleep(seconds)
        frames, cpu, wrote = counts[0] - frames0, cpu_seconds(server.pid) - cpu0, written_bytes(server.pid) - bytes0
        rss = rss_bytes(server.pid) - rss0
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    row = {
        "mode": mode,
        "subscribers": n,
        "interval_ms": interval,
        "frames": frames,
        "bytes_per_update": wrote / frames if frames else float("nan"),
        "cpu_us_per_frame": 1e6 * cpu / frames if frames else float("nan"),
        "rss_kib_per_connection": rss / n / 1024,
    }
    progress(f"{mode} x{n}: {frames} frames, {row['bytes_per_update']:.0f} B and {row['cpu_us_per_frame']:.1f} us each")
    return row


async def live(args: argparse.Namespace) -> list[dict[str, Any]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    rows = []
    for n in args.subscribers:
        for mode in MODES:
            rows.append(await live_phase(mode, n, args.seconds))
    print("live, one uvicorn process (bytes written to the sockets and server CPU, per delivered update):")
    print(f"  {'subs':>5} {'mode':>13} {'bytes':>6} {'vs full':>8} {'CPU us':>7} {'vs full':>8} {'KiB/conn':>9}")
    for n in args.subscribers:
        full = next(r for r in rows if r["subscribers"] == n and r["mode"] == "full")
        for r in (r for r in rows if r["subscribers"] == n):
            r["bytes_ratio"] = full["bytes_per_update"] / r["bytes_per_update"]
            r["cpu_ratio"] = r["cpu_us_per_frame"] / full["cpu_us_per_frame"]
            print(
                f"  {n:>5} {r['mode']:>13} {r['bytes_per_update']:>6.0f} {r['bytes_ratio']:>7.1f}x "
                f"{r['cpu_us_per_frame']:>7.1f} {r['cpu_ratio']:>7.2f}x {r['rss_kib_per_connection']:>9.0f}"
            )
    return rows


class Reader:
    """A client on a small socket that reads only when told: the value it holds."""

    def __init__(self, url: str, channel: str) -> None:
        self.url, self.channel = url, channel
        self.held_ts: int | None = None  # the publication time of the value it holds
        self.ws: Any = None

    async def open(self) -> None:
        import websockets

        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # what the guard cannot see: small
        host, port = self.url.split("/")[2].split(":")
        sock.connect((host, int(port)))
        self.ws = await websockets.connect(
            self.url, origin="http://127.0.0.1", max_size=None, compression=None, sock=sock, max_queue=1
        )
        await self.ws.send(
            json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": self.channel}, "id": 1})
        )
        await self.ws.recv()
        self.ws.transport.pause_reading()

    async def read(self, quiet: float) -> None:
        """All that is there, then whatever comes until ``quiet`` seconds pass without a frame."""
        self.ws.transport.resume_reading()
        with contextlib.suppress(TimeoutError):
            while True:
                message = json.loads(await asyncio.wait_for(self.ws.recv(), quiet))
                if message.get("method") == "message":
                    self.held_ts = message["params"]["ts"]
        self.ws.transport.pause_reading()


#: The staleness readers: (feed, policy) -> channel of the bench site (bench/asgi.py).
FEEDS = {
    ("steady", "conflate"): "bench:conflated",
    ("steady", "drop"): "bench:dropped",
    ("bursty", "conflate"): "bench:burst-conflated",
    ("bursty", "drop"): "bench:burst-dropped",
}


async def staleness(args: argparse.Namespace) -> dict[str, Any]:
    import websockets

    port = free_port()
    rules = [{"pattern": c, "backpressure": "conflate"} for (_, policy), c in FEEDS.items() if policy == "conflate"]
    env = {
        "REDIS_URL": "",
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "REALTIME_MAX_BACKPRESSURE": str(64 * 1024),
        "REALTIME_CLOSE_AFTER_DROPS": "1000000",
        "REALTIME_BENCH_OVERRIDES": json.dumps({"POLICIES": rules}),
    }
    with processes([uvicorn(port, deflate=False)], [port], env):
        url = f"ws://127.0.0.1:{port}/realtime/"
        readers = {f"{feed} {policy}": Reader(url, channel) for (feed, policy), channel in FEEDS.items()}
        for reader in readers.values():
            await reader.open()
        newest: dict[str, int] = {}  # per channel, the newest publication time

        async def reference() -> None:  # what a reader that keeps up holds, per channel
            async with websockets.connect(url, origin="http://127.0.0.1", max_size=None, compression=None) as ws:
                for i, reader in enumerate(readers.values()):
                    params = {"channel": reader.channel}
                    await ws.send(json.dumps({"jsonrpc": "2.0", "method": "subscribe", "params": params, "id": i}))
                while True:
                    message = json.loads(await ws.recv())
                    if message.get("method") == "message":
                        params = message["params"]
                        newest[params["channel"]] = max(newest.get(params["channel"], 0), params["ts"])

        ref = asyncio.create_task(reference())
        series: dict[str, list[tuple[float, float]]] = {name: [] for name in readers}
        after: dict[str, list[float]] = {name: [] for name in readers}
        started = time.monotonic()

        def behind(reader: Reader) -> float:
            if reader.held_ts is None or reader.channel not in newest:
                return float("nan")
            return float(max(0, newest[reader.channel] - reader.held_ts))

        async def sample() -> None:
            while True:
                for name, reader in readers.items():
                    series[name].append((time.monotonic() - started, behind(reader)))
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        for i in range(args.reads):
            await asyncio.sleep(2.5)
            await asyncio.gather(*(reader.read(QUIET_S) for reader in readers.values()))
            for name, reader in readers.items():
                after[name].append(behind(reader))
            progress(f"read {i + 1}/{args.reads}: " + ", ".join(f"{n} {after[n][-1]:.0f}" for n in readers) + " ms")
        sampler.cancel()
        ref.cancel()
        for reader in readers.values():
            reader.ws.transport.resume_reading()
            await reader.ws.close()
    print("staleness: 16 KiB frames at 10 Hz, steady or in bursts (1.5 s of every 3.1 s); a reader every")
    print("  2.5 s (threshold 64 KiB): how far behind the newest publication its value is after each read:")
    for name, values in after.items():
        late = [v for v in values if v > 150]
        print(
            f"  {name:>15}: {len(late):>2} of {len(values)} reads more than a publication behind"
            + (f" (median of those {statistics.median(late):.0f} ms, max {max(late):.0f} ms)" if late else "")
        )
    return {"after_read_ms": after, "series": series}


#: How long a read waits for more after the last frame: a little over one of the hub's
#: drains of held frames (every 50 ms), under one publication interval (100 ms).
QUIET_S = 0.06


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, after) = plt.subplots(2, 1, figsize=(8, 5.6), gridspec_kw={"height_ratios": [3, 2]})
    colors = {"drop": "tab:red", "conflate": "tab:blue"}
    for policy in ("drop", "conflate"):
        points = result["staleness"]["series"][f"bursty {policy}"]
        ax.plot([t for t, _ in points], [v / 1000 for _, v in points], color=colors[policy], label=policy, lw=1.1)
    ax.set_xlabel("time (s): 10 Hz for 1.5 s of every 3.1 s; the reader reads every 2.5 s")
    ax.set_ylabel("behind the newest (s)")
    ax.set_title("What a slow reader of a state channel holds: drop vs conflate")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    for feed, marker in (("steady", "x"), ("bursty", "o")):
        for policy in ("drop", "conflate"):
            values = result["staleness"]["after_read_ms"][f"{feed} {policy}"]
            after.plot(range(1, len(values) + 1), values, marker, color=colors[policy], label=f"{feed}, {policy}")
    after.set_xlabel("read")
    after.set_ylabel("after the read (ms)")
    after.legend(loc="upper right", fontsize="small", ncol=2)
    after.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only", nargs="+", choices=["codec", "live", "staleness"], default=["codec", "live", "staleness"]
    )
    parser.add_argument("--publications", type=int, default=1000)
    parser.add_argument("--subscribers", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window of each live phase")
    parser.add_argument("--reads", type=int, default=12, help="reads of the staleness phase, 2.5 s apart")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if "codec" in args.only:
        result["codec"] = codec(args)
    if "live" in args.only:
        result["live"] = asyncio.run(live(args))
    if "staleness" in args.only:
        result["staleness"] = asyncio.run(staleness(args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot and "staleness" in result:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
