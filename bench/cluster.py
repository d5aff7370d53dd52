"""A simulated cluster against the capacity model (docs/capacity.md): 8 daphne processes
on 1 and on 3 Redis shards, measured beside what ``bench/capacity.py`` predicts.

Each phase starts its own ``redis-server`` processes (one per shard, private, on free
ports) and ``--processes`` daphne processes of the bench site with ``REDIS_URL`` listing
the shards. ``--channels`` ticker channels (``bench:dash:<ms>``, a 2.3 KiB dashboard state,
each its own cadence near 10 Hz) have subscribers on every process: process *i* holds
``1 + i % 3`` clients, each subscribed to every channel. Over a window of ``--seconds``:

* per shard: Redis commands per second (``INFO commandstats``), output bytes, Redis CPU;
  **predicted**: the model's commands per second for the same load (the measured
  publication rate of each channel, the processes, the shards), and the ratio;
* per process: CPU (and, first, its idle CPU: one connection, no subscription), frames
  delivered, publications led (the leases it holds); the model's per-process costs are
  fitted on the 1-shard phase (least squares over the CPU beyond idle: per delivered
  frame, per publication led, per publication received) and **predict** the 3-shard one.

Usage:  python bench/cluster.py [--processes 8] [--shards 1 3] [--channels 24]
            [--seconds 15] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import websockets

from bench.capacity import Costs, Load, commands_per_s, process_cpu
from bench.common import as_new_client, cpu_seconds, daphne, free_port, processes, progress, rss_bytes
from realtime_app.cluster.shards import shard_of
from realtime_app.wire.names import group_name
from tests.support.private_redis import PrivateRedis


def redis_stats(server: PrivateRedis) -> dict[str, float]:
    client = server.client()
    commands = sum(int(v["calls"]) for v in client.info("commandstats").values())
    stats, cpu = client.info("stats"), client.info("cpu")
    return {
        "memory": int(client.info("memory")["used_memory"]),
        "commands": commands,
        "out_bytes": int(stats["total_net_output_bytes"]),
        "cpu": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
    }


class Subscriber:
    """One client of one process, subscribed to every channel: frames counted, last seq kept."""

    def __init__(self, url: str, channels: list[str]) -> None:
        self.url, self.channels = url, channels
        self.frames = 0
        self.seq: dict[str, int] = {}
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        async with websockets.connect(
            self.url,
            origin="http://127.0.0.1",
            additional_headers=as_new_client(),
            max_size=None,
            compression=None,
            ping_interval=None,
        ) as ws:
            for i, channel in enumerate(self.channels):
                request = {"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": channel}, "id": i}
                await ws.send(json.dumps(request))
            async for raw in ws:
                message = json.loads(raw)
                if message.get("method") == "message":
                    self.frames += 1
                    self.seq[message["params"]["channel"]] = message["params"]["seq"]


async def phase(shard_count: int, args: argparse.Namespace) -> dict[str, Any]:
    shards = [PrivateRedis().start() for _ in range(shard_count)]
    prefix = f"bench-cluster-{secrets.token_hex(3)}"
    overrides = {"MAX_CADENCES_PER_FAMILY": 0, "MAX_TICKERS": 0}
    env = {
        "DJANGO_SETTINGS_MODULE": "bench.settings",
        "REDIS_URL": ",".join(s.url for s in shards),
        "REALTIME_KEY_PREFIX": prefix,
        "REALTIME_BENCH_OVERRIDES": json.dumps(overrides),
    }
    channels = [f"bench:dash:{args.interval_ms + i}" for i in range(args.channels)]
    ports = [free_port() for _ in range(args.processes)]
    try:
        with processes([daphne(port) for port in ports], ports, env) as procs:
            idle_clients = [Subscriber(f"ws://127.0.0.1:{port}/realtime/", []) for port in ports]
            for sub in idle_clients:  # a connection each: the hub runs (its beat, probe, check)
                sub.task = asyncio.create_task(sub.run())
            await asyncio.sleep(3)
            i0, started = [cpu_seconds(p.pid) for p in procs], time.monotonic()
            q0 = [redis_stats(s) for s in shards]
            await asyncio.sleep(args.idle_seconds)
            q1 = [redis_stats(s) for s in shards]
            idle_redis = {  # what an idle process costs Redis, per second (all shards)
                kind: sum(b[kind] - a[kind] for a, b in zip(q0, q1, strict=True))
                / (time.monotonic() - started)
                / len(procs)
                for kind in ("commands", "out_bytes")
            }
            idle = [(cpu_seconds(p.pid) - c) / (time.monotonic() - started) for p, c in zip(procs, i0, strict=True)]
            rss_idle = [rss_bytes(p.pid) for p in procs]
            redis_idle = [redis_stats(s)["memory"] for s in shards]
            subscribers: list[list[Subscriber]] = []
            for i, port in enumerate(ports):
                mine = [Subscriber(f"ws://127.0.0.1:{port}/realtime/", channels) for _ in range(1 + i % 3)]
                for sub in mine:
                    sub.task = asyncio.create_task(sub.run())
                subscribers.append(mine)
            everyone = [s for mine in subscribers for s in mine]
            deadline = time.monotonic() + 90
            while not all(len(s.seq) == len(channels) for s in everyone):
                if time.monotonic() > deadline:
                    raise RuntimeError("not every client had a frame of every channel in 90 s")
                await asyncio.sleep(0.2)
            progress(f"{shard_count} shard(s): {len(everyone)} clients have frames of all {len(channels)} channels")
            await asyncio.sleep(3)  # leases settled
            r0 = [redis_stats(s) for s in shards]
            c0 = [cpu_seconds(p.pid) for p in procs]
            f0 = [sum(s.frames for s in mine) for mine in subscribers]
            seq0 = dict(everyone[0].seq)
            t0 = time.monotonic()
            await asyncio.sleep(args.seconds)
            window = time.monotonic() - t0
            r1 = [redis_stats(s) for s in shards]
            c1 = [cpu_seconds(p.pid) for p in procs]
            rss_busy = [rss_bytes(p.pid) for p in procs]
            f1 = [sum(s.frames for s in mine) for mine in subscribers]
            seq1 = dict(everyone[0].seq)
            holders: dict[str, int] = {}
            for channel in channels:
                shard = shards[shard_of(channel, shard_count)].client()
                holder = shard.get(f"{prefix}:lease:{group_name(channel)}") or ""
                holders[channel] = int(holder.split("-")[-2]) if holder.count("-") >= 2 else -1
            pids = [p.pid for p in procs]
            for sub in everyone + idle_clients:
                assert sub.task is not None
                sub.task.cancel()
            await asyncio.gather(*(s.task for s in everyone + idle_clients if s.task), return_exceptions=True)
    finally:
        for server in shards:
            server.close()
    rates = {c: (seq1[c] - seq0[c]) / window for c in channels}
    redis_growth = sum(r["memory"] for r in r1) - sum(redis_idle)
    publications = sum(rates.values())
    load = Load(processes=args.processes, shards=shard_count, rates=rates)
    predicted = commands_per_s(load)
    measured = [(b["commands"] - a["commands"]) / window for a, b in zip(r0, r1, strict=True)]
    shard_rows = [
        {
            "shard": i,
            "channels": sum(1 for c in channels if shard_of(c, shard_count) == i),
            "commands_per_s": measured[i],
            "predicted_per_s": predicted[i],
            "ratio": measured[i] / predicted[i],
            "out_bytes_per_s": (r1[i]["out_bytes"] - r0[i]["out_bytes"]) / window,
            "redis_cpu": (r1[i]["cpu"] - r0[i]["cpu"]) / window,
        }
        for i in range(shard_count)
    ]
    process_rows = [
        {
            "process": i,
            "clients": len(subscribers[i]),
            "cpu": (c1[i] - c0[i]) / window,
            "idle_cpu": idle[i],
            "frames_per_s": (f1[i] - f0[i]) / window,
            "led_per_s": sum(rates[c] for c in channels if holders[c] == pids[i]),
            "received_per_s": publications,
        }
        for i in range(args.processes)
    ]
    return {
        "shards": shard_count,
        "publications_per_s": publications,
        # memory per channel: a process's growth once subscribed (its few clients included)
        # and Redis' (keys, pub/sub subscriptions of every process), over the channels
        "idle_redis_commands_per_process_s": idle_redis["commands"],
        "idle_redis_bytes_per_process_s": idle_redis["out_bytes"],
        "process_kib_per_channel": statistics.mean(b - a for a, b in zip(rss_idle, rss_busy, strict=True))
        / len(channels)
        / 1024,
        "redis_kib_per_channel": redis_growth / len(channels) / 1024,
        "shard_rows": shard_rows,
        "process_rows": process_rows,
    }


def fit_costs(rows: list[dict[str, Any]], shard_rows: list[dict[str, Any]], publications: float) -> Costs:
    """Per-process costs by least squares over the processes of one phase: CPU beyond the
    process's idle (measured before any subscription: its beat, probe and checks) = frames
    x frame_us + led x publication_us + received x received_us."""
    import numpy as np

    a = np.array([[r["frames_per_s"], r["led_per_s"], r["received_per_s"]] for r in rows])
    b = np.array([(r["cpu"] - r["idle_cpu"]) * 1e6 for r in rows])
    (frame_us, publication_us, received_us), *_ = np.linalg.lstsq(a, b, rcond=None)
    redis_cpu = sum(s["redis_cpu"] for s in shard_rows)
    out = sum(s["out_bytes_per_s"] for s in shard_rows)
    messages = publications * len(rows)  # every process has subscribers of every channel
    return Costs(
        frame_us=float(frame_us),
        publication_us=float(publication_us),
        received_us=float(received_us),
        redis_message_us=1e6 * redis_cpu / messages,
        redis_out_bytes=out / messages,
    )


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    labels, measured, predicted = [], [], []
    for result in results:
        for row in result["shard_rows"]:
            labels.append(f"{result['shards']} shard{'s' if result['shards'] > 1 else ''}\nshard {row['shard']}")
            measured.append(row["commands_per_s"])
            predicted.append(row["predicted_per_s"])
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured", color="tab:blue")
    ax.bar([x + 0.2 for x in xs], predicted, 0.4, label="model", color="tab:gray")
    ax.set_xticks(list(xs), labels, fontsize="small")
    ax.set_ylabel("Redis commands / s")
    ax.set_title("8 processes: Redis commands per shard, measured vs the model")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--channels", type=int, default=24)
    parser.add_argument(
        "--interval-ms", type=int, default=101, help="the first cadence (+1 ms each; 100 is the default)"
    )
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="each process's idle CPU, measured first")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    results = [asyncio.run(phase(n, args)) for n in args.shards]
    base = min(results, key=lambda r: r["shards"])  # the costs are fitted on the fewest shards
    costs = fit_costs(base["process_rows"], base["shard_rows"], base["publications_per_s"])
    print(
        f"{args.processes} daphne processes, {args.channels} channels, {base['publications_per_s']:.0f} publications/s"
    )
    print("Redis commands per second per shard, measured and predicted by the model:")
    for result in results:
        for row in result["shard_rows"]:
            print(
                f"  {result['shards']} shard(s), shard {row['shard']} ({row['channels']:>2} channels): "
                f"{row['commands_per_s']:>7.0f} measured, {row['predicted_per_s']:>7.0f} predicted "
                f"({row['ratio'] - 1:+.1%}); Redis CPU {row['redis_cpu']:.1%}, "
                f"out {row['out_bytes_per_s'] / 1e6:.1f} MB/s"
            )
    print(
        f"process costs (fitted on {base['shards']} shard(s)): {costs.frame_us:.1f} us per delivered frame, "
        f"{costs.publication_us:.0f} us per publication led, {costs.received_us:.1f} us per publication received; "
        f"Redis {costs.redis_message_us:.1f} us and {costs.redis_out_bytes:.0f} B out per message "
        "(a publication to a subscribed process)"
    )
    idle = {r["shards"]: statistics.mean(p["idle_cpu"] for p in r["process_rows"]) for r in results}
    print(
        "idle CPU per process (a connection, no subscription): "
        + ", ".join(f"{v:.1%} on {k} shard(s)" for k, v in idle.items())
    )
    for r in results:
        print(
            f"an idle process costs Redis, on {r['shards']} shard(s): {r['idle_redis_commands_per_process_s']:.1f} "
            f"commands/s, {r['idle_redis_bytes_per_process_s']:.0f} B/s out"
        )
    print(
        f"memory per channel: {base['process_kib_per_channel']:.1f} KiB in each process with subscribers, "
        f"{base['redis_kib_per_channel']:.1f} KiB in Redis"
    )
    for result in (r for r in results if r is not base):
        print(f"CPU per process on {result['shards']} shards, measured and predicted:")
        for row in result["process_rows"]:
            predicted = row["idle_cpu"] + process_cpu(
                costs, row["frames_per_s"], row["led_per_s"], row["received_per_s"]
            )
            print(
                f"  process {row['process']} ({row['clients']} clients, leads {row['led_per_s']:.0f}/s): "
                f"{row['cpu']:.1%} measured, {predicted:.1%} predicted ({row['cpu'] / predicted - 1:+.1%})"
            )
    if args.json:
        args.json.write_text(json.dumps({"results": results, "costs": costs.__dict__}, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
