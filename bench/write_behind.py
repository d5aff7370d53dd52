"""Write-behind vs write-through on PostgreSQL: statements, wall time, accept latency.

In one run, on a fresh database of its own: ``--mutations`` (10,000) random ``shots -= 1``
over ``--objects`` (1,000) inventory rows, first through the write-behind store (the
objects preloaded, one query per 500; mutations accepted in memory; flushed in batches
every 0.5 s, and at the end everything), then write-through the usual way
(``select_for_update`` + ``save()`` per mutation, in a transaction). It counts the SQL
statements each sent, the wall time, and the latency until a mutation is accepted
(p50/p99), and checks that both end with the same rows.

Usage: python bench/write_behind.py [--mutations 10000] [--objects 1000]
       [--pg postgres://postgres@127.0.0.1:5432/postgres] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


class Counter:
    """Counts the statements of every connection (an ``execute_wrapper`` per new one)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        self.count += 1
        return execute(sql, params, many, context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mutations", type=int, default=10_000)
    parser.add_argument("--objects", type=int, default=1_000)
    default_pg = os.environ.get("REALTIME_TEST_PG_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--pg", default=default_pg)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import psycopg

    name = f"rt_bench_wb_{os.getpid()}"
    libpq = args.pg.replace("postgres://", "postgresql://", 1)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        result = run(args, args.pg.rsplit("/", 1)[0] + f"/{name}")
    finally:
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


def run(args: argparse.Namespace, database_url: str) -> dict[str, Any]:
    os.environ["DJANGO_SETTINGS_MODULE"] = "project.settings"
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("REALTIME_LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection, transaction

    call_command("migrate", verbosity=0)
    from django.contrib.auth import get_user_model

    from project.demo.models import InventoryItem
    from realtime_app.persistence.write_behind import WriteBehindStore

    users = [get_user_model().objects.create(username=f"bench{i}").pk for i in range(args.objects // 10)]
    keys = [(users[i % len(users)], f"item{i // len(users)}") for i in range(args.objects)]
    rng = random.Random(7)
    plan = [keys[rng.randrange(len(keys))] for _ in range(args.mutations)]
    start = 10_000

    # -- write-behind ------------------------------------------------------------------
    store: WriteBehindStore[InventoryItem] = WriteBehindStore(
        InventoryItem,
        key=("user_id", "item"),
        fields=("shots",),
        counters=("shots",),
        defaults=lambda key: {"shots": start},
        delay_s=0.5,
        name="bench",
    )
    counter = Counter()

    async def behind() -> tuple[list[float], float]:
        from asgiref.sync import sync_to_async

        await sync_to_async(lambda: connection.execute_wrappers.append(counter))()
        latencies = []
        started = time.perf_counter()
        await store.preload(keys)  # one query per 500 objects, counted
        for i, key in enumerate(plan):
            t = time.perf_counter()
            await store.add(key, "shots", -1)
            latencies.append((time.perf_counter() - t) * 1000)
            if i % 1000 == 0:
                print(f"  … write-behind: {i}/{len(plan)} accepted", file=sys.stderr, flush=True)
            if i % 200 == 0:
                await asyncio.sleep(0)  # the flush loop runs beside the producer
        await store.flush(everything=True)
        return latencies, time.perf_counter() - started

    behind_latencies, behind_s = asyncio.run(behind())
    behind_state = {(r.user_id, r.item): r.shots for r in InventoryItem.objects.all()}
    behind_statements = counter.count
    InventoryItem.objects.all().delete()

    # -- write-through -----------------------------------------------------------------
    through = Counter()
    through_latencies = []
    with connection.execute_wrapper(through):
        started = time.perf_counter()
        for i, (user_id, item) in enumerate(plan):
            t = time.perf_counter()
            with transaction.atomic():
                row, _ = InventoryItem.objects.select_for_update().get_or_create(
                    user_id=user_id, item=item, defaults={"shots": start}
                )
                row.shots -= 1
                row.save(update_fields=["shots"])
            through_latencies.append((time.perf_counter() - t) * 1000)
            if i % 1000 == 0:
                print(f"  … write-through: {i}/{len(plan)} saved", file=sys.stderr, flush=True)
        through_s = time.perf_counter() - started
    through_state = {(r.user_id, r.item): r.shots for r in InventoryItem.objects.all()}

    result = {
        "mutations": len(plan),
        "objects": len(set(plan)),
        "behind": {
            "statements": behind_statements,
            "wall_s": behind_s,
            "accept_p50_ms": percentile(behind_latencies, 50),
            "accept_p99_ms": percentile(behind_latencies, 99),
            "flushes": store.flushes,
        },
        "through": {
            "statements": through.count,
            "wall_s": through_s,
            "accept_p50_ms": percentile(through_latencies, 50),
            "accept_p99_ms": percentile(through_latencies, 99),
        },
        "equal": behind_state == through_state,
    }
    b, t = result["behind"], result["through"]
    print(f"\n{len(plan)} mutations over {result['objects']} objects, PostgreSQL")
    print(f"{'':<15}{'statements':>11}{'wall s':>9}{'accept p50 ms':>15}{'accept p99 ms':>15}")
    for label, row in (("write-behind", b), ("write-through", t)):
        print(
            f"{label:<15}{row['statements']:>11}{row['wall_s']:>9.2f}{row['accept_p50_ms']:>15.3f}"
            f"{row['accept_p99_ms']:>15.3f}"
        )
    print(
        f"\nstatements: {t['statements'] / b['statements']:.1f}x fewer; wall time {t['wall_s'] / b['wall_s']:.1f}x "
        f"less; rows equal at the end: {result['equal']}"
    )
    return result


if __name__ == "__main__":
    main()
