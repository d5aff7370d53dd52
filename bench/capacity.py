"""The capacity model of docs/capacity.md: what a cluster costs Redis and its processes,
as formulas over the load, with constants read from the code (Redis commands) or
measured on this machine (CPU, bytes). ``bench/cluster.py`` holds it against a simulated
cluster; ``python bench/capacity.py`` prints what it predicts for larger ones.

Redis commands, as ``INFO commandstats`` counts them (a Lua script's own calls included):

* a publication (no history): ``EVALSHA`` + ``INCR`` + ``PEXPIRE`` + ``PUBLISH`` = 4, on
  its channel's shard;
* per beat (a third of ``LEASE_TTL_MS``) and ticker channel: its holder renews (``EVALSHA``
  + ``GET`` + ``PEXPIRE`` = 3), each other subscribed process competes (``SET NX`` = 1);
* per beat, process and shard: the check (``SET NX`` of its sentinel key + ``INFO``) = 2;
* per probe (every ``PROBE_TTL_MS / 3``) and process, on the home shard: ``SET`` +
  ``ZADD`` + ``ZREMRANGEBYSCORE`` + ``PEXPIRE`` = 4;
* per re-assert (every ``REASSERT_INTERVAL_MS``), process and subscribed channel: reseed
  (``EVALSHA`` + ``GET`` + ``PTTL`` + ``PEXPIRE``) and join (a wake ``PUBLISH`` +
  ``SUBSCRIBE``) = 6.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from realtime_app.cluster.shards import shard_of

PUBLISH_CMDS = 4
RENEW_CMDS = 3
ACQUIRE_CMDS = 1
CHECK_CMDS = 2
PROBE_CMDS = 4
REASSERT_CMDS = 6


@dataclass
class Load:
    """A cluster and what it carries."""

    processes: int
    shards: int
    rates: dict[str, float]  # ticker channel -> publications per second
    subscribed: dict[str, int] = field(default_factory=dict)  # channel -> processes with subscribers (all)
    lease_ttl_ms: int = 3000
    probe_ttl_ms: int = 6000
    reassert_ms: int = 60000

    def holders(self, channel: str) -> int:
        return self.subscribed.get(channel, self.processes)


def commands_per_s(load: Load, shard_index: dict[str, int] | None = None) -> list[float]:
    """Redis commands per second on each shard (index 0 is the home shard)."""
    beat_s = load.lease_ttl_ms / 3000
    probe_s = max(1, round(load.probe_ttl_ms / 3 / (beat_s * 1000))) * beat_s
    out = [load.processes * CHECK_CMDS / beat_s for _ in range(load.shards)]
    out[0] += load.processes * PROBE_CMDS / probe_s
    for channel, rate in load.rates.items():
        s = shard_index[channel] if shard_index else shard_of(channel, load.shards)
        k = load.holders(channel)
        out[s] += rate * PUBLISH_CMDS + (RENEW_CMDS + (k - 1) * ACQUIRE_CMDS) / beat_s
        out[s] += k * REASSERT_CMDS / (load.reassert_ms / 1000)
    return out


@dataclass
class Costs:
    """Measured on this machine (bench/cluster.py, bench/bandwidth.py; docs/capacity.md)."""

    frame_us: float  # process CPU per delivered frame (its guard, its socket write)
    publication_us: float  # process CPU per publication it leads (the ticker's holder)
    received_us: float  # process CPU per publication it receives from the backplane
    redis_message_us: float  # Redis CPU per message it sends (a publication x a subscribed process)
    redis_out_bytes: float  # Redis output bytes per such message


def process_cpu(costs: Costs, frames_per_s: float, led_per_s: float, received_per_s: float) -> float:
    """Cores one process uses beyond its idle."""
    return (frames_per_s * costs.frame_us + led_per_s * costs.publication_us + received_per_s * costs.received_us) / 1e6


def scenario(costs: Costs, processes: int, connections: int, channels: int, hz: float, shards: int) -> dict[str, float]:
    """Every connection on one channel, spread evenly; every process has subscribers of
    every channel (each publication reaches every process: the most Redis sends)."""
    rates = {f"load:{i}": hz for i in range(channels)}
    load = Load(processes=processes, shards=shards, rates=rates)
    per_shard = commands_per_s(load)
    busiest = max(range(shards), key=lambda i: per_shard[i])
    publications = channels * hz
    on_busiest = sum(hz for c in rates if shard_of(c, shards) == busiest)
    messages = on_busiest * processes  # what the busiest shard sends per second
    return {
        "process_cores": process_cpu(costs, connections * hz, publications / processes, publications),
        "frames_per_process": connections * hz,
        "redis_commands_per_s": per_shard[busiest],
        "redis_cores": messages * costs.redis_message_us / 1e6,
        "redis_out_mb_per_s": messages * costs.redis_out_bytes / 1e6,
    }


SCENARIOS = [
    ("10 processes x 10,000 connections, 1,000 channels at 10 Hz", 10, 10_000, 1000, 10.0),
    ("100 processes x 10,000 connections, 1,000 channels at 10 Hz", 100, 10_000, 1000, 10.0),
    ("10 processes x 10,000 connections, 100 channels at 1 Hz", 10, 10_000, 100, 1.0),
    ("100 processes x 10,000 connections, 100 channels at 1 Hz", 100, 10_000, 100, 1.0),
]


def first_limit(row: dict[str, float], nic_mb_per_s: float = 1250.0) -> str:
    """What saturates first: a process (one core: Python), a shard's Redis (one core for
    commands), or a shard's network (10 GbE by default)."""
    loads = {
        ("a process", "of a core"): row["process_cores"],
        ("a shard's Redis", "of a core"): row["redis_cores"],
        ("a shard's network", "of 10 GbE"): row["redis_out_mb_per_s"] / nic_mb_per_s,
    }
    (name, unit), used = max(loads.items(), key=lambda item: item[1])
    return f"{name}: {used:.0%} {unit}" if used > 0.7 else f"none (the most: {name}, {used:.0%} {unit})"


def predictions(costs: Costs, shard_counts: tuple[int, ...] = (1, 3, 10)) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name, p, conns, channels, hz in SCENARIOS:
        for shards in shard_counts:
            row = scenario(costs, p, conns, channels, hz, shards)
            rows.append({"scenario": name, "shards": shards, **row, "first_limit": first_limit(row)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="What the capacity model predicts (docs/capacity.md).")
    parser.add_argument("--frame-us", type=float, default=22.0, help="bench/bandwidth.py, 1,000 subscribers")
    parser.add_argument("--publication-us", type=float, default=710.0, help="bench/cluster.py")
    parser.add_argument("--received-us", type=float, default=235.0, help="bench/cluster.py")
    parser.add_argument("--redis-message-us", type=float, default=28.3, help="bench/cluster.py")
    parser.add_argument("--redis-out-bytes", type=float, default=2446.0, help="bench/cluster.py")
    args = parser.parse_args()
    costs = Costs(args.frame_us, args.publication_us, args.received_us, args.redis_message_us, args.redis_out_bytes)
    print(
        "| load | shards | a process, cores | busiest shard: commands/s | its Redis, cores | its output | first limit |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for row in predictions(costs):
        print(
            f"| {row['scenario']} | {row['shards']} | {row['process_cores']:.2f} | "
            f"{row['redis_commands_per_s']:,.0f} | {row['redis_cores']:.2f} | "
            f"{row['redis_out_mb_per_s']:,.0f} MB/s | {row['first_limit']} |"
        )


if __name__ == "__main__":
    main()
