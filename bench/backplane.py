"""The backplanes side by side: PostgreSQL (``LISTEN``/``NOTIFY`` and tables) vs Redis
(pub/sub and Lua), at 1, 2 and 4 receiving processes, in one run.

Each phase starts ``N`` receiver processes (this script with ``--receive``), each a
backplane of the kind under test that joins ``--channels`` channels, as a process with
subscribers would. This process publishes ``--rate`` publications a second in all, spread
over the channels (one publisher task per channel: a channel's publications go one after
the other, as the hub sends them), for ``--seconds``. Measured per phase:

* publications/s achieved, and the publisher's own p50/p99 call time;
* publish-to-delivery p50/p99 over every delivery of every receiver (the publication's
  wall-clock time, carried in its data, to its arrival in the receiver's callback);
* deliveries missing (each receiver should get every publication of every channel);
* the database's CPU per 1,000 publications: PostgreSQL — the backends serving the
  backplanes' connections (``pg_stat_activity`` by application name) — Redis — the
  server process (``INFO server``'s ``process_id``); both from ``/proc``.

It uses the machine's PostgreSQL and Redis (``--postgres``, ``--redis``), a database of its
own (created, made as ``migrate`` makes it, dropped) and a key prefix of its own.

Usage:  python bench/backplane.py [--processes 1 2 4] [--rate 1000] [--channels 10]
            [--seconds 10] [--postgres postgres://postgres@127.0.0.1:5432/postgres]
            [--redis redis://127.0.0.1:6379/0] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")

from bench.common import cpu_seconds, percentile, progress

ROOT = Path(__file__).resolve().parent.parent


def libpq(url: str) -> str:
    return url.replace("postgres://", "postgresql://", 1)


class BareNotify:
    """PostgreSQL's own floor: ``pg_notify`` of the same text through a pool of as many
    connections, received with ``LISTEN`` and psycopg's ``notifies()`` — no table, no
    function, no numbering. What the PostgreSQL backplane adds is the difference."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.url, self.size, self.opened = libpq(args.database), args.pool_size, 0
        self.name = f"rt-bench {args.prefix}"  # its backends' CPU is measured
        self.pool: asyncio.Queue[Any] = asyncio.Queue()
        self.listener: Any = None
        self.task: asyncio.Task[None] | None = None
        self.deliver: Any = None

    async def start(self, deliver: Any) -> None:
        import psycopg

        self.listener = await psycopg.AsyncConnection.connect(self.url, autocommit=True, application_name=self.name)
        self.deliver = deliver

    async def join(self, names: list[str]) -> None:
        from realtime_app.cluster.base import Delivery

        for name in names:
            await self.listener.execute(f'LISTEN "{name}"')

        async def receive() -> None:
            async for note in self.listener.notifies():
                await self.deliver(Delivery("frame", note.channel, note.payload))

        self.task = asyncio.get_running_loop().create_task(receive())

    async def publish(self, channel: str, data_json: str) -> int:
        import psycopg

        if self.pool.empty() and self.opened < self.size:
            self.opened += 1
            options = "-c synchronous_commit=off"
            conn = await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, options=options, application_name=self.name
            )
            self.pool.put_nowait(conn)
        conn = await self.pool.get()
        try:
            text = f'{{"jsonrpc":"2.0","method":"message","params":{{"channel":"{channel}","data":{data_json}}}}}'
            await conn.execute("SELECT pg_notify(%s, %s)", [channel, text])
        finally:
            self.pool.put_nowait(conn)
        return 0

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        while not self.pool.empty():
            await self.pool.get_nowait().close()
        if self.listener is not None:
            await self.listener.close()


def make(kind: str, args: argparse.Namespace, instance: str) -> Any:
    import django

    django.setup()
    if kind == "notify":
        return BareNotify(args)
    config = {"KEY_PREFIX": args.prefix, "REDIS_URL": args.redis, "POSTGRES_POOL_SIZE": args.pool_size}
    if kind == "postgres":
        from realtime_app.cluster.postgres import PostgresBackplane

        params = {"conninfo": libpq(args.database), "application_name": f"rt-bench {args.prefix}"}
        return PostgresBackplane(instance_id=instance, config=config, params=params)
    from realtime_app.cluster.redis import RedisBackplane

    return RedisBackplane(instance_id=instance, config=config)


def channels(count: int) -> list[str]:
    return [f"bench:bp:{n}" for n in range(count)]


async def receive(args: argparse.Namespace) -> None:
    """One receiving process: print ``ready``, then, once the publisher's end mark arrived
    (or at the deadline), one JSON line of latencies (ms)."""
    latencies: list[float] = []
    done = asyncio.Event()

    async def deliver(delivery: Any) -> None:
        data = json.loads(delivery.text)["params"]["data"]
        if data.get("end"):  # published after every other: all of them came before it
            done.set()
            return
        latencies.append((time.time() - data["t"]) * 1000)

    backplane = make(args.receive, args, f"recv-{os.getpid()}")
    await backplane.start(deliver)
    await backplane.join(channels(args.channels))
    print("ready", flush=True)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), args.seconds + 30)
    await backplane.stop()
    print(json.dumps(latencies), flush=True)


async def publish_for(backplane: Any, args: argparse.Namespace) -> tuple[int, list[float]]:
    """Publish ``--rate`` a second over the channels for ``--seconds``: (count, call ms)."""
    per_channel = args.rate / args.channels
    calls: list[float] = []

    async def one_channel(channel: str) -> int:
        start, sent = time.monotonic(), 0
        while (elapsed := time.monotonic() - start) < args.seconds:
            due = sent / per_channel
            if due > elapsed:
                await asyncio.sleep(due - elapsed)
            began = time.perf_counter()
            await backplane.publish(channel, json.dumps({"t": time.time()}))
            calls.append((time.perf_counter() - began) * 1000)
            sent += 1
        return sent

    counts = await asyncio.gather(*(one_channel(c) for c in channels(args.channels)))
    return sum(counts), calls


async def database_pids(kind: str, args: argparse.Namespace) -> list[int]:
    if kind == "redis":
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(args.redis)
        try:
            return [int((await client.info("server"))["process_id"])]
        finally:
            await client.aclose()
    import psycopg

    async with await psycopg.AsyncConnection.connect(libpq(args.database), autocommit=True) as conn:
        rows = await (
            await conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s", [f"rt-bench {args.prefix}"]
            )
        ).fetchall()
    return [int(pid) for (pid,) in rows]


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def start(command: list[str], count: int) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for _ in range(count)
    ]


async def phase(kind: str, receivers: int, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, __file__, "--receive", kind]
    command += ["--channels", str(args.channels), "--seconds", str(args.seconds), "--prefix", args.prefix]
    command += ["--database", args.database, "--redis", args.redis, "--pool-size", str(args.pool_size)]
    procs = start(command, receivers)
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = await asyncio.to_thread(proc.stdout.readline)
            if line.strip() != "ready":
                raise RuntimeError(f"a receiver did not start: {line!r}")
        backplane = make(kind, args, "bench-publisher")
        await backplane.publish(channels(1)[0], json.dumps({"t": time.time()}))  # connections opened
        pids = await database_pids(kind, args)
        cpu_before, started = cpu_of(pids), time.monotonic()
        published, calls = await publish_for(backplane, args)
        elapsed = time.monotonic() - started
        cpu = cpu_of(pids) - cpu_before
        await backplane.publish(channels(1)[0], json.dumps({"end": True}))
        await backplane.stop()
        latencies: list[float] = []
        for proc in procs:
            out, _ = await asyncio.to_thread(proc.communicate, timeout=args.seconds + 60)
            latencies += json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    # the warm-up publication reached channel 0 of every receiver too
    missing = max(0, (published + 1) * receivers - len(latencies))
    return {
        "backplane": kind,
        "processes": receivers,
        "publications_per_s": round(published / elapsed, 1),
        "publish_call_p50_ms": round(percentile(calls, 50), 2),
        "publish_call_p99_ms": round(percentile(calls, 99), 2),
        "delivery_p50_ms": round(percentile(latencies, 50), 2),
        "delivery_p99_ms": round(percentile(latencies, 99), 2),
        "deliveries": len(latencies),
        "missing": missing,
        "database_cpu_s_per_1000": round(cpu / max(published, 1) * 1000, 4),
    }


def create_database(server: str, name: str, create: bool) -> str:
    import psycopg

    from realtime_app.cluster.postgres_sql import INSTALL

    with psycopg.connect(libpq(server), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if create:
            conn.execute(f'CREATE DATABASE "{name}"')
    url = server.rsplit("/", 1)[0] + f"/{name}"
    if create:
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute(INSTALL)  # what migrate runs (migration 0005)
    return url


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, colour in (("redis", "tab:red"), ("postgres", "tab:blue"), ("notify", "tab:gray")):
        rows = [r for r in results if r["backplane"] == kind]
        xs = [r["processes"] for r in rows]
        name = {"notify": "bare NOTIFY (floor)"}.get(kind, kind)
        ax.plot(xs, [r["delivery_p99_ms"] for r in rows], "o-", color=colour, label=f"{name} p99")
        ax.plot(xs, [r["delivery_p50_ms"] for r in rows], "o--", color=colour, alpha=0.6, label=f"{name} p50")
    ax.set_xlabel("receiving processes")
    ax.set_ylabel("publish-to-delivery, ms")
    ax.set_xticks(sorted({r["processes"] for r in results}))
    ax.set_title(f"Backplanes at {results[0]['publications_per_s']:.0f} publications/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main(args: argparse.Namespace) -> None:
    args.prefix = f"bench-bp-{secrets.token_hex(3)}"
    name = args.prefix.replace("-", "_")
    args.database = create_database(args.postgres, name, create=True)
    results = []
    try:
        for receivers in args.processes:
            for kind in args.kinds:  # side by side, alternating
                progress(f"{kind}, {receivers} receiving process(es), {args.rate}/s for {args.seconds} s")
                results.append(await phase(kind, receivers, args))
    finally:
        create_database(args.postgres, name, create=False)
        import redis

        client = redis.Redis.from_url(args.redis)
        for key in client.scan_iter(match=f"{args.prefix}*"):
            client.delete(key)
    header = f"{'backplane':9} {'procs':>5} {'pub/s':>7} {'call p99':>9} {'p50 ms':>7} {'p99 ms':>7} "
    print(header + f"{'missing':>7} {'db cpu s/1000':>13}")
    for r in results:
        print(
            f"{r['backplane']:9} {r['processes']:>5} {r['publications_per_s']:>7} {r['publish_call_p99_ms']:>9} "
            f"{r['delivery_p50_ms']:>7} {r['delivery_p99_ms']:>7} {r['missing']:>7} {r['database_cpu_s_per_1000']:>13}"
        )
    for receivers in args.processes:
        row = {r["backplane"]: r for r in results if r["processes"] == receivers}
        if "postgres" in row and "redis" in row:
            pg, rd = row["postgres"], row["redis"]
            print(
                f"{receivers} process(es): PostgreSQL / Redis "
                f"p99 {pg['delivery_p99_ms'] / rd['delivery_p99_ms']:.2f}×, "
                f"p50 {pg['delivery_p50_ms'] / rd['delivery_p50_ms']:.2f}×, "
                f"database CPU {pg['database_cpu_s_per_1000'] / max(rd['database_cpu_s_per_1000'], 1e-9):.1f}×"
            )
        if "postgres" in row and "notify" in row:
            pg, floor = row["postgres"], row["notify"]
            print(
                f"{receivers} process(es): PostgreSQL backplane / bare NOTIFY p99 "
                f"{pg['delivery_p99_ms'] / floor['delivery_p99_ms']:.2f}×, "
                f"p50 {pg['delivery_p50_ms'] / floor['delivery_p50_ms']:.2f}×"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--channels", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--postgres", default="postgres://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--pool-size", type=int, default=4, help="POSTGRES_POOL_SIZE of each process")
    parser.add_argument(
        "--kinds", nargs="+", default=["redis", "postgres", "notify"], choices=["redis", "postgres", "notify"]
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    # a receiving process (started by the run itself)
    parser.add_argument("--receive", choices=["postgres", "redis", "notify"])
    parser.add_argument("--prefix", default="")
    parser.add_argument("--database", default="")
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse()
    asyncio.run(receive(arguments) if arguments.receive else main(arguments))
