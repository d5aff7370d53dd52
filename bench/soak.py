"""Soak: a two-process cluster under churn, dead clients and two Redis restarts.

Two daphne processes of the demo site share a private ``redis-server`` started here (never
the machine's shared one). About ``--clients`` clients connect, subscribe to one to three
channels, stay a random while and leave, replaced at once; 5 % of them never read (on
``demo:flood:50``, so the guard closes them with 1013); one publisher sends 5 events a
second. Redis is killed (SIGKILL) and restarted empty at one third and two thirds of the
run. Every 5 s it samples each server's RSS, the probe totals, Redis' key count and the
frames received; at the end every client leaves and it waits for the probe and the keys
to come back to their baseline (keys without a TTL as before the clients came; keys with
one — sequences, group sets — expire on their own).

Prints: RSS slope after warm-up (MB/min, per process; the warm-up lasts until the dead
clients' queues are full and the first of them are closed, 180 s by default), frames per second around each
restart, the probe and the key count at the end; writes the series (JSON) and a plot.

Usage: python bench/soak.py [--minutes 10] [--clients 500] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import websockets

from bench.common import as_new_client, daphne, free_port, prepare_database, processes, progress, rss_bytes
from tests.support.private_redis import PrivateRedis

MIB = 1024 * 1024
PREFIX = "soak"
CHANNELS = ["demo:clock", "demo:clock:2000", "demo:clock:500", "demo:events"]


class Stats:
    def __init__(self) -> None:
        self.frames = 0
        self.connected = 0
        self.other_closes: dict[int, int] = {}


async def live_client(url: str, stats: Stats, lifetime: float, dead: bool) -> None:
    """One client: subscribe, read (or not), leave after ``lifetime`` seconds."""
    try:
        ws = await websockets.connect(
            url, origin="http://127.0.0.1", additional_headers=as_new_client(), max_size=None, open_timeout=30
        )
    except (OSError, websockets.WebSocketException, TimeoutError):
        return
    stats.connected += 1
    try:
        channels = ["demo:flood:50"] if dead else random.sample(CHANNELS, random.randint(1, 3))
        for i, channel in enumerate(channels):
            request = {"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": channel}, "id": i}
            await ws.send(json.dumps(request))
        if dead:
            ws.transport.pause_reading()
            await asyncio.sleep(lifetime)
            return
        deadline = time.monotonic() + lifetime
        while (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(ws.recv(), left)
            except TimeoutError:
                break
            stats.frames += 1
    except websockets.ConnectionClosed as closed:
        code = closed.rcvd.code if closed.rcvd else 1006
        stats.other_closes[code] = stats.other_closes.get(code, 0) + 1
    finally:
        stats.connected -= 1
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.close(), 2)


async def population(urls: list[str], target: int, stats: Stats, stop: asyncio.Event) -> None:
    """Keep about ``target`` clients alive; each leaves after 5-60 s (a dead one after
    240-360 s: filling the socket buffers, the guard's 4 MiB and a drop balance of 1000
    takes about two minutes at 640 KB/s) and is replaced."""
    running: set[asyncio.Task[None]] = set()
    while not stop.is_set():
        while len(running) < target:
            dead = random.random() < 0.05  # stays long enough for the guard to close it
            lifetime = random.uniform(240, 360) if dead else random.uniform(5, 60)
            task = asyncio.create_task(live_client(random.choice(urls), stats, lifetime, dead))
            running.add(task)
            task.add_done_callback(running.discard)
            if len(running) % 50 == 0:
                await asyncio.sleep(0.05)  # connect in waves, not all at once
        await asyncio.sleep(0.2)
    for task in list(running):
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


async def publisher(url: str, stop: asyncio.Event) -> None:
    n = 0
    while not stop.is_set():
        try:
            async with websockets.connect(url, origin="http://127.0.0.1", additional_headers=as_new_client()) as ws:
                while not stop.is_set():
                    n += 1
                    request = {"jsonrpc": "2.0", "method": "publish", "id": n}
                    request["params"] = {"channel": "demo:events", "data": {"n": n}}
                    await ws.send(json.dumps(request))
                    await ws.recv()
                    await asyncio.sleep(0.2)
        except (OSError, websockets.WebSocketException, TimeoutError):
            await asyncio.sleep(1)


def read_probes(redis_server: PrivateRedis) -> list[dict[str, Any]]:
    try:
        client = redis_server.client()
        ids = client.zrangebyscore(f"{PREFIX}:instances", time.time() * 1000, "+inf")
        return [json.loads(r) for r in client.mget([f"{PREFIX}:probe:{i}" for i in ids]) if r] if ids else []
    except Exception:
        return []


def key_count(redis_server: PrivateRedis) -> int | None:
    try:
        return int(redis_server.client().dbsize())
    except Exception:
        return None


def keys_by_kind(redis_server: PrivateRedis) -> dict[str, int]:
    """Keys that stay (no TTL) and keys that expire on their own, by kind."""
    client = redis_server.client()
    out: dict[str, int] = {}
    for key in client.scan_iter(count=1000):
        kind = key.split(":")[1] if ":" in key else key
        kind += " (expires)" if client.pttl(key) >= 0 else " (stays)"
        out[kind] = out.get(kind, 0) + 1
    return dict(sorted(out.items()))


def slope_mb_per_min(samples: list[tuple[float, int]]) -> float:
    xs = [t for t, _ in samples]
    ys = [r / MIB for _, r in samples]
    if len(xs) < 2:
        return float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 60 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    duration = args.minutes * 60
    redis_server = PrivateRedis().start()
    database = prepare_database(os.path.join(redis_server.dir, "db.sqlite3"))
    env = {
        **database,
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "REDIS_URL": redis_server.url,
        "REALTIME_KEY_PREFIX": PREFIX,
        "REALTIME_DEMO_FLOOD": "1",
        "REALTIME_LOG_LEVEL": "WARNING",
        # a dead client is closed once it refused 200 frames more than it took (1000 by
        # default: at a loaded machine's flood rate that outlasts a 10-minute run)
        "REALTIME_CLOSE_AFTER_DROPS": str(args.close_after_drops),
    }
    ports = [free_port(), free_port()]
    commands = [daphne(port, "project.asgi:application") for port in ports]
    urls = [f"ws://127.0.0.1:{port}/realtime/" for port in ports]
    series: list[dict[str, Any]] = []
    restarts: list[float] = []
    try:
        with processes(commands, ports, env) as procs:
            for port in ports:  # a process's hub starts with its first request
                await asyncio.to_thread(
                    lambda p=port: urllib.request.urlopen(f"http://127.0.0.1:{p}/accounts/login/").read()
                )
            await asyncio.sleep(3)
            baseline = keys_by_kind(redis_server)
            stats, stop = Stats(), asyncio.Event()
            tasks = [
                asyncio.create_task(population(urls, args.clients, stats, stop)),
                asyncio.create_task(publisher(urls[0], stop)),
            ]
            start = time.monotonic()
            restart_at = [duration / 3, 2 * duration / 3]
            last_frames = 0
            while (elapsed := time.monotonic() - start) < duration:
                if restart_at and elapsed >= restart_at[0]:
                    restart_at.pop(0)
                    progress(f"{elapsed:.0f} s: killing Redis (SIGKILL), restarting it empty in 5 s")
                    redis_server.kill()
                    await asyncio.sleep(5)
                    redis_server.start()
                    restarts.append(time.monotonic() - start)
                await asyncio.sleep(5)
                found = read_probes(redis_server)
                sample = {
                    "t": round(time.monotonic() - start, 1),
                    "rss_mb": [round(rss_bytes(p.pid) / MIB, 1) for p in procs],
                    "clients": stats.connected,
                    "connections": sum(p["connections"] for p in found),
                    "subscriptions": sum(p["subscriptions"] for p in found),
                    "tickers": sum(p.get("ticker_count", len(p["tickers"])) for p in found),
                    "keys": key_count(redis_server),
                    "frames_per_s": round((stats.frames - last_frames) / 5, 1),
                    # the guard's 1013 closes, from the probe (a client that never reads never sees them)
                    "closes_1013": sum(p.get("backpressure", {}).get("closes", 0) for p in found),
                    "drops": sum(p.get("backpressure", {}).get("drops", 0) for p in found),
                }
                last_frames = stats.frames
                series.append(sample)
                progress(
                    f"{sample['t']:.0f} s: {sample['clients']} clients, RSS {sample['rss_mb']} MB, "
                    f"{sample['frames_per_s']} frames/s, {sample['tickers']} tickers, {sample['keys']} keys, "
                    f"{sample['closes_1013']} closed with 1013"
                )
            stop.set()
            await asyncio.gather(*tasks)
            progress("every client left; waiting for the probe and Redis to come back to baseline")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                found = read_probes(redis_server)
                totals = {k: sum(p[k] for p in found) for k in ("connections", "subscriptions")}
                totals["tickers"] = sum(p.get("ticker_count", len(p["tickers"])) for p in found)
                keys = keys_by_kind(redis_server)
                staying = {k: v for k, v in keys.items() if k.endswith("(stays)")}
                if len(found) == 2 and not any(totals.values()) and staying == baseline:
                    break
                await asyncio.sleep(1)
            final = {"probe": totals, "instances": len(found), "keys": keys, "baseline_keys": baseline}
    finally:
        redis_server.close()
    warm = [s for s in series if s["t"] >= args.warmup]
    slopes = [slope_mb_per_min([(s["t"], int(s["rss_mb"][i] * MIB)) for s in warm]) for i in range(2)]
    around = []
    for moment in restarts:
        before = [s["frames_per_s"] for s in series if moment - 30 <= s["t"] < moment - 5]
        after = [s["frames_per_s"] for s in series if moment + 5 <= s["t"] < moment + 30]
        around.append(
            {"restart_s": round(moment, 1), "frames_per_s_before": _mean(before), "frames_per_s_after": _mean(after)}
        )
    return {
        "minutes": args.minutes,
        "clients": args.clients,
        "rss_slope_mb_per_min_after_warmup": [round(s, 2) for s in slopes],
        "rss_mb_first_last": [series[0]["rss_mb"], series[-1]["rss_mb"]] if series else None,
        "restarts": around,
        "closes_seen_by_reading_clients": stats.other_closes,
        "closes_1013": max((s["closes_1013"] for s in series), default=0),
        "drops": max((s["drops"] for s in series), default=0),
        "rss_mb_max_after_warmup": [max((s["rss_mb"][i] for s in warm), default=None) for i in range(2)],
        "final": final,
        "series": series,
    }


def _mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 1) if values else float("nan")


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = result["series"]
    t = [s["t"] / 60 for s in series]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for i in range(2):
        axes[0].plot(t, [s["rss_mb"][i] for s in series], label=f"daphne {i + 1} RSS (MB)")
    axes[0].set_ylabel("MB")
    axes[1].plot(t, [s["clients"] for s in series], label="clients connected")
    axes[1].plot(t, [s["frames_per_s"] for s in series], label="frames received / s")
    axes[1].plot(t, [s.get("closes_1013", 0) for s in series], label="dead clients closed with 1013 (total)")
    axes[2].plot(t, [s["keys"] if s["keys"] is not None else float("nan") for s in series], label="Redis keys")
    axes[2].plot(t, [s["tickers"] for s in series], label="tickers (cluster)")
    axes[2].set_xlabel("minutes")
    for ax in axes:
        for r in result["restarts"]:
            ax.axvline(r["restart_s"] / 60, color="red", linestyle="--", linewidth=1)
        ax.legend(loc="upper left", fontsize=8)
    axes[0].set_title("Soak: churn, 5 % dead clients, Redis killed at the red lines")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--close-after-drops", type=int, default=200)
    parser.add_argument(
        "--warmup", type=float, default=180, help="seconds before the RSS slope is measured (dead clients fill up)"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    summary = {k: v for k, v in result.items() if k != "series"}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
