"""AnyCable's jitter profile: clients force-closed every ~15 s, ~2 s offline, 2 messages a
second on a channel with history; every message delivered, and how late the replayed ones are.

One or two daphne processes of the bench site on Redis; ``--clients`` Python
``RealtimeClient``s (this package's client, as an application would use it) subscribe to
``demo:events`` (history: 1,000 events / 5 min) and resume from their last position after
each drop. Each client drops its connection without a close frame (the TCP connection
aborted: what a phone losing its network does) after 10–20 s (15 s on average), and comes
back after its reconnect backoff, set to 1.3–2.6 s (2 s on average). This process publishes
``--rate`` messages a second (``apublish``) for ``--seconds``, then waits until every
client holds what was published while it was subscribed (or 30 s).

It prints the delivered fraction (every publication since each client's first subscribe,
counted once per client), the resyncs (gaps the history could not fill), and the latency
of live and of replayed messages (a message is replayed when it was published while its
client was away): from publication to delivery, and for replayed ones also from the
moment the client was back (its socket open again) to delivery.

Usage:  REDIS_URL=redis://127.0.0.1:6379/0 python bench/jitter.py [--clients 200]
            [--seconds 60] [--rate 2] [--processes 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from bench.common import as_new_client, daphne, drop_keys, free_port, percentile, processes, progress, redis_site

CHANNEL = "demo:events"


@dataclass
class Jittered:
    """One client's record: what it received when, and when it was away."""

    client: Any
    received: dict[int, float] = field(default_factory=dict)  # seq -> wall time received
    away: list[list[float]] = field(default_factory=list)  # [dropped at, open again at]
    since: float = 0.0  # first subscribed
    resyncs: int = 0
    drops: int = 0

    def was_away(self, t: float) -> list[float] | None:
        for span in self.away:
            if span[0] <= t <= (span[1] or float("inf")):
                return span
        return None


async def open_client(url: str, rng: random.Random) -> Jittered:
    from realtime_app.client import RealtimeClient

    client = RealtimeClient(url, headers=as_new_client(), backoff_initial=2.6, backoff_max=2.6)
    record = Jittered(client)

    def on_message(params: dict[str, Any]) -> None:
        record.received.setdefault(params["seq"], time.time())

    def on_state(state: str) -> None:
        if state == "open" and record.away and not record.away[-1][1]:
            record.away[-1][1] = time.time()

    def on_resync(channel: str, info: dict[str, Any]) -> None:
        record.resyncs += 1

    client.on_state.append(on_state)
    client.on_resync.append(on_resync)
    await client.connect(60)
    await client.subscribe(CHANNEL, on_message)
    record.since = time.time()
    return record


async def jitter(record: Jittered, rng: random.Random, stop: asyncio.Event) -> None:
    """Abort the client's TCP connection every 10–20 s (no close frame)."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.uniform(10, 20))
        if stop.is_set():
            return
        ws = record.client.socket.ws
        if ws is None or record.client.state != "open":
            continue  # still away from the last drop
        record.away.append([time.time(), 0.0])
        record.drops += 1
        ws.transport.abort()


async def publisher(rate: float, published: list[tuple[float, int]], stop: asyncio.Event) -> None:
    from realtime_app import apublish

    loop = asyncio.get_running_loop()
    deadline = loop.time()
    n = 0
    while not stop.is_set():
        n += 1
        t = time.time()
        seq = await apublish(CHANNEL, {"n": n, "t": t, "text": "a message of about the size of a chat line"})
        published.append((t, seq))
        deadline += 1 / rate
        await asyncio.sleep(max(0, deadline - loop.time()))


async def run(args: argparse.Namespace, urls: list[str]) -> dict[str, Any]:
    from realtime_app import apublish

    await apublish(CHANNEL, {"warm": True})  # this process's hub started before the clock does
    rng = random.Random(args.seed)
    records: list[Jittered] = []
    for i in range(args.clients):
        records.append(await open_client(urls[i % len(urls)], rng))
        if (i + 1) % 50 == 0:
            progress(f"{i + 1}/{args.clients} clients subscribed")
    stop = asyncio.Event()
    published: list[tuple[float, int]] = []
    tasks = [asyncio.create_task(jitter(r, random.Random(rng.random()), stop)) for r in records]
    pub = asyncio.create_task(publisher(args.rate, published, stop))
    t0 = time.monotonic()
    while (elapsed := time.monotonic() - t0) < args.seconds:
        await asyncio.sleep(min(5.0, args.seconds - elapsed))
        away = sum(1 for r in records if r.client.state != "open")
        progress(f"{elapsed:.0f}/{args.seconds:.0f} s, {len(published)} published, {away} clients away now")
    stop.set()
    await pub
    await asyncio.gather(*tasks)
    last = published[-1][0] if published else time.time()

    def missing() -> int:
        return sum(1 for r in records for t, seq in published if t >= r.since and seq not in r.received)

    deadline = time.monotonic() + 30
    while missing() and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    caught_up_s = max((max(r.received.values(), default=last) for r in records), default=last) - last
    expected = delivered = 0
    live: list[float] = []
    replayed: list[float] = []
    after_back: list[float] = []
    for r in records:
        for t, seq in published:
            if t < r.since:
                continue
            expected += 1
            got = r.received.get(seq)
            if got is None:
                continue
            delivered += 1
            span = r.was_away(t)
            if span is None:
                live.append((got - t) * 1000)
            else:
                replayed.append((got - t) * 1000)
                if span[1]:
                    after_back.append((got - span[1]) * 1000)
    for r in records:
        await r.client.close()
    return {
        "clients": args.clients,
        "processes": len(urls),
        "seconds": args.seconds,
        "rate": args.rate,
        "published": len(published),
        "drops": sum(r.drops for r in records),
        "expected": expected,
        "delivered": delivered,
        "delivered_pct": 100 * delivered / expected if expected else float("nan"),
        "resyncs": sum(r.resyncs for r in records),
        "live_p50_ms": percentile(live, 50),
        "live_p99_ms": percentile(live, 99),
        "replayed": len(replayed),
        "replay_p50_ms": percentile(replayed, 50),
        "replay_p99_ms": percentile(replayed, 99),
        "after_back_p99_ms": percentile(after_back, 99),
        "last_delivery_after_last_publication_s": caught_up_s,
    }


def report(row: dict[str, Any]) -> None:
    print(
        f"{row['clients']} clients on {row['processes']} process(es), {row['rate']} msg/s for {row['seconds']:.0f} s: "
        f"{row['published']} published, {row['drops']} forced drops"
    )
    print(f"delivered {row['delivered']}/{row['expected']} = {row['delivered_pct']:.3f} %, resyncs {row['resyncs']}")
    print(f"live: p50 {row['live_p50_ms']:.1f} ms, p99 {row['live_p99_ms']:.1f} ms")
    print(
        f"replayed ({row['replayed']}): publication to delivery p50 {row['replay_p50_ms']:.0f} ms, "
        f"p99 {row['replay_p99_ms']:.0f} ms; back to delivery p99 {row['after_back_p99_ms']:.0f} ms"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    # Clients reconnect all the time here: the handshake limits are admission, not this.
    url, prefix, env = redis_site({"MAX_ANONYMOUS_HANDSHAKES_PER_S": 0, "HANDSHAKES_PER_S": 0})
    os.environ.update(env)
    import django

    django.setup()
    ports = [free_port() for _ in range(args.processes)]
    try:
        with processes([daphne(p) for p in ports], ports, env):
            row = await run(args, [f"ws://127.0.0.1:{p}/realtime/" for p in ports])
    finally:
        drop_keys(url, prefix)
    report(row)
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
