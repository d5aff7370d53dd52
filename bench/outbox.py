"""Publications through the outbox vs direct, on PostgreSQL and Redis, in one run.

On a fresh database of its own and a key prefix of its own on Redis, one process runs a
hub and a subscriber (in-process, through the real endpoint) of two channels of the test
app with the same history: ``test:big-history`` (a publication made in a transaction is
sent on commit: **direct**) and ``test:durable`` (a durable channel: the publication is an
outbox row of the transaction, drained by the hub: **outbox**). A worker thread commits
``--count`` transactions of one publication each on one channel, then on the other; it
prints publications per second (commit to the last delivery) and the latency from each
commit to its delivery (p50/p99), and the ratio outbox / direct.

Usage: python bench/outbox.py [--count 2000] [--pg postgres://postgres@127.0.0.1:5432/postgres]
       [--redis redis://127.0.0.1:6379/0] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import percentile, progress


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument(
        "--pg", default=os.environ.get("REALTIME_TEST_PG_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--redis", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import psycopg
    import redis

    name = f"rt_bench_outbox_{os.getpid()}"
    prefix = f"rt-bench-outbox-{secrets.token_hex(3)}"
    libpq = args.pg.replace("postgres://", "postgresql://", 1)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        result = run(args, args.pg.rsplit("/", 1)[0] + f"/{name}", prefix)
    finally:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        client = redis.Redis.from_url(args.redis)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()
    for mode in ("direct", "outbox"):
        r = result[mode]
        latency = f"commit → delivery p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms"
        print(f"{mode:7} {r['per_s']:>8.0f} publications/s   {latency}")
    print(f"outbox / direct: throughput {result['throughput_ratio']:.2f}x, p50 latency {result['p50_ratio']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def run(args: argparse.Namespace, database_url: str, prefix: str) -> dict[str, Any]:
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    os.environ["DATABASE_URL"] = database_url
    os.environ["REDIS_URL"] = args.redis
    os.environ["REALTIME_KEY_PREFIX"] = prefix
    os.environ.setdefault("REALTIME_LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return asyncio.run(measure(args.count))


def commit_each(channel: str, count: int) -> None:
    """``count`` transactions of one publication each (as a view or a task would)."""
    from django.db import transaction

    import realtime_app

    for i in range(count):
        with transaction.atomic():
            realtime_app.publish(channel, {"i": i, "t": time.time()})


async def measure(count: int) -> dict[str, Any]:
    from asgiref.sync import sync_to_async

    from realtime_app.hub import get_hub
    from tests.support.asgi_client import Client

    hub = await get_hub()
    result: dict[str, Any] = {"count": count}
    try:
        for mode, channel in (("direct", "test:big-history"), ("outbox", "test:durable")):
            progress(f"{mode}: {count} commits on {channel}")
            async with Client() as subscriber:
                await subscriber.call("subscribe", {"channel": channel})
                started = time.perf_counter()
                publishing = asyncio.ensure_future(sync_to_async(commit_each, thread_sensitive=False)(channel, count))
                latencies: list[float] = []
                while len(latencies) < count:
                    message = await subscriber.recv(timeout=60)
                    if message.get("method") == "message":
                        latencies.append((time.time() - message["params"]["data"]["t"]) * 1000)
                elapsed = time.perf_counter() - started
                await publishing
            result[mode] = {
                "per_s": round(count / elapsed, 1),
                "p50_ms": round(percentile(latencies, 50), 2),
                "p99_ms": round(percentile(latencies, 99), 2),
            }
    finally:
        await hub.aclose()
    result["throughput_ratio"] = round(result["outbox"]["per_s"] / result["direct"]["per_s"], 3)
    result["p50_ratio"] = round(result["outbox"]["p50_ms"] / result["direct"]["p50_ms"], 3)
    return result


if __name__ == "__main__":
    main()
