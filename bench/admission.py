"""Admission: what a decision costs, and what it buys a server that abusive clients flood.

(a) The pure core: microseconds per decision (``Admission.admit`` + ``release``) over many
    identities, and per refusal.

(b) In one run, on fresh daphne processes of the demo site (in-memory layer), three phases:

* ``idle``  — 20 well-behaved clients ping every 100 ms, nobody else (admission on);
* ``on``    — the same plus ``--abusers`` connections (in a process of their own) firing
  ``demo.sleep {ms}`` as fast as they can: each keeps ``--window`` requests outstanding and
  sends again as soon as one is answered, refused or not, and connects again a second after
  the server closes it — admission with the defaults;
* ``off``   — the same with every cap and the bucket off (``ADMISSION_MAX_PENDING = 0``,
  ``ADMISSION_MAX_PER_IDENTITY = 0``, ``ADMISSION_BUCKET_CAPACITY = 0``) and a pool as
  large as the flood (``ADMISSION_MAX_RUNNING = 100000``): every request is accepted.

It prints, per phase: well-behaved ping p50/p99 (and p99 over ``idle``'s), refusals
answered p99 (request to refusal), the server's peak RSS, requests completed and refused,
and how many times the server closed an abuser (1008: it ignored its refusals).

Usage: python bench/admission.py [--seconds 30] [--abusers 100] [--polite 20] [--sleep-ms 200]
       [--window 50] [--reconnect-s 1.0] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import websockets

from bench.common import ROOT, daphne, free_port, percentile, prepare_database, processes, progress, rss_bytes

MIB = 1024 * 1024
OFF = {
    "ADMISSION_MAX_PENDING": 0,
    "ADMISSION_MAX_PER_IDENTITY": 0,
    "ADMISSION_BUCKET_CAPACITY": 0,
    "ADMISSION_MAX_RUNNING": 100000,
}


def decision_cost(n: int = 200_000) -> dict[str, float]:
    """µs per admitted decision (admit + release) and per refusal, of the pure core."""
    from realtime_app.admission import Admission, AdmissionLimits

    admission = Admission(AdmissionLimits())
    identities = [("connection", str(i)) for i in range(1000)]
    started = time.perf_counter()
    for i in range(n):
        identity = identities[i % 1000]
        if admission.admit(identity, 0.25) is None:
            admission.release(identity)
    admitted_us = (time.perf_counter() - started) / n * 1e6
    empty = Admission(AdmissionLimits(refill_per_s=0.001, bucket_capacity=1))
    empty.admit("x", 1)
    started = time.perf_counter()
    for _ in range(n):
        empty.admit("x", 1)
    refused_us = (time.perf_counter() - started) / n * 1e6
    return {"admitted_us": admitted_us, "refused_us": refused_us}


async def polite(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    async with websockets.connect(url, origin=url.replace("ws://", "http://").split("/realtime")[0]) as ws:
        ids = itertools.count()
        while not stop.is_set():
            request_id = next(ids)
            started = time.perf_counter()
            await ws.send(json.dumps({"jsonrpc": "2.0", "method": "ping", "id": request_id}))
            while json.loads(await ws.recv()).get("id") != request_id:
                pass
            latencies.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(0.1)


async def abuser(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    """Keeps ``window`` demo.sleep requests outstanding, sending again as soon as one is
    answered — refused or not; closed by the server, it connects again a second later."""
    while not stop.is_set():
        await abuse_once(url, stop, args, stats)
        if not args.reconnect_s:
            await stop.wait()
        elif not stop.is_set():
            await asyncio.sleep(args.reconnect_s)


async def abuse_once(url: str, stop: asyncio.Event, args: argparse.Namespace, stats: dict[str, Any]) -> None:
    try:
        async with websockets.connect(
            url, origin=url.replace("ws://", "http://").split("/realtime")[0], max_queue=None
        ) as ws:
            sent: dict[int, float] = {}
            ids = itertools.count()
            params = {"ms": args.sleep_ms}

            async def send_one() -> None:
                request_id = next(ids)
                sent[request_id] = time.perf_counter()
                request = {"jsonrpc": "2.0", "method": "demo.sleep", "params": params, "id": request_id}
                await ws.send(json.dumps(request))

            for _ in range(args.window):
                await send_one()
            while not stop.is_set():
                try:
                    answer = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
                except TimeoutError:
                    continue
                started = sent.pop(answer.get("id"), None)
                if "error" in answer:
                    stats["refused"] += 1
                    if started is not None:
                        stats["refusal_ms"].append((time.perf_counter() - started) * 1000)
                else:
                    stats["completed"] += 1
                await send_one()
    except (OSError, websockets.ConnectionClosed):
        stats["disconnected"] += 1


async def abusers_main(args: argparse.Namespace) -> None:
    """``--role abusers``: the abusive population in a process of its own (so that its
    event loop does not delay the well-behaved clients' measurements); prints its stats."""
    stop = asyncio.Event()
    stats: dict[str, Any] = {"completed": 0, "refused": 0, "disconnected": 0, "refusal_ms": []}
    tasks = [asyncio.create_task(abuser(args.url, stop, args, stats)) for _ in range(args.abusers)]
    await asyncio.sleep(args.seconds)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    refusal = sorted(stats.pop("refusal_ms"))
    stats["refusal_p99_ms"] = refusal[int(0.99 * (len(refusal) - 1))] if refusal else 0.0
    print(json.dumps(stats), flush=True)


async def phase(name: str, env: dict[str, str], args: argparse.Namespace, abusers: int) -> dict[str, Any]:
    port = free_port()
    url = f"ws://127.0.0.1:{port}/realtime/"
    with processes([daphne(port)], [port], env) as procs:
        pid = procs[0].pid
        stop = asyncio.Event()
        latencies: list[float] = []
        flood = None
        if abusers:
            flood = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--role", "abusers", "--url", url, "--abusers", str(abusers),
                "--seconds", str(args.seconds + 1.0), "--sleep-ms", str(args.sleep_ms), "--window", str(args.window),
                "--reconnect-s", str(args.reconnect_s),
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            await asyncio.sleep(1.0)
        tasks = [asyncio.create_task(polite(url, stop, latencies)) for _ in range(args.polite)]
        peak = 0
        t0 = time.monotonic()
        series: list[tuple[float, int]] = []
        while (elapsed := time.monotonic() - t0) < args.seconds:
            rss = rss_bytes(pid)
            peak = max(peak, rss)
            series.append((elapsed, rss))
            if len(series) % 10 == 0:
                progress(f"{name}: {elapsed:.0f}/{args.seconds:.0f} s, RSS {rss / MIB:.0f} MiB")
            await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        stats: dict[str, Any] = {"completed": 0, "refused": 0, "disconnected": 0, "refusal_p99_ms": 0.0}
        if flood is not None:
            out, _ = await flood.communicate()
            stats = json.loads(out.decode().strip().splitlines()[-1])
    return {
        "phase": name,
        "ping_p50_ms": percentile(latencies, 50),
        "ping_p99_ms": percentile(latencies, 99),
        "pings": len(latencies),
        "refusal_p99_ms": stats["refusal_p99_ms"],
        "completed": stats["completed"],
        "refused": stats["refused"],
        "disconnected": stats["disconnected"],
        "rss_start_mib": series[0][1] / MIB,
        "rss_peak_mib": peak / MIB,
        "rss_end_mib": series[-1][1] / MIB,
        "series": series,
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss_ax, bar_ax) = plt.subplots(1, 2, figsize=(10, 3.6))
    for row in results:
        xs = [t for t, _ in row["series"]]
        rss_ax.plot(xs, [r / MIB for _, r in row["series"]], label=row["phase"])
    rss_ax.set_xlabel("s")
    rss_ax.set_ylabel("server RSS, MiB")
    rss_ax.legend()
    names = [row["phase"] for row in results]
    bar_ax.bar(names, [row["ping_p99_ms"] for row in results], color=["#888", "#2a7", "#c33"][: len(results)])
    bar_ax.set_ylabel("well-behaved ping p99, ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--abusers", type=int, default=100)
    parser.add_argument("--polite", type=int, default=20)
    parser.add_argument("--sleep-ms", type=int, default=200)
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--reconnect-s", type=float, default=1.0, help="abusers reconnect after a close (0: never)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--role", choices=["bench", "abusers"], default="bench", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "abusers":
        await abusers_main(args)
        return
    os.chdir(ROOT)

    cost = decision_cost()
    print(
        f"pure core: {cost['admitted_us']:.2f} µs per admitted decision (admit + release), "
        f"{cost['refused_us']:.2f} µs per refusal"
    )
    db = prepare_database(str(Path(tempfile.mkdtemp()) / "db.sqlite3"))
    base = {**db, "REDIS_URL": "", "DJANGO_SETTINGS_MODULE": "bench.settings", "REALTIME_LOG_LEVEL": "ERROR"}
    on = {**base, "REALTIME_BENCH_OVERRIDES": "{}"}
    off = {**base, "REALTIME_BENCH_OVERRIDES": json.dumps(OFF)}
    results = [
        await phase("idle", on, args, 0),
        await phase("on", on, args, args.abusers),
        await phase("off", off, args, args.abusers),
    ]
    idle_p99 = results[0]["ping_p99_ms"]
    print(
        f"\n{args.abusers} abusive connections (demo.sleep {args.sleep_ms} ms, {args.window} outstanding each), "
        f"{args.polite} well-behaved clients pinging every 100 ms, {args.seconds:.0f} s per phase"
    )
    print(
        f"{'phase':<6}{'ping p50':>9}{'p99 ms':>8}{'p99/idle':>9}{'refusal p99':>12}{'RSS start→peak MiB':>20}"
        f"{'completed':>10}{'refused':>9}{'closed':>8}"
    )
    for row in results:
        span = f"{row['rss_start_mib']:.0f} → {row['rss_peak_mib']:.0f}"
        print(
            f"{row['phase']:<6}{row['ping_p50_ms']:>9.1f}{row['ping_p99_ms']:>8.1f}"
            f"{row['ping_p99_ms'] / idle_p99:>9.2f}{row['refusal_p99_ms']:>12.1f}{span:>20}"
            f"{row['completed']:>10}{row['refused']:>9}{row['disconnected']:>8}"
        )
    if args.json:
        args.json.write_text(json.dumps({"decision": cost, "phases": results}, indent=2))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    asyncio.run(main())
