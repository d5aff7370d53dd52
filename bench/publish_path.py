"""CPU per publication, published and received in one process, by three paths side by side:

* ``backplane``: the Redis backplane — one Lua call numbers and ``PUBLISH``es, the process's
  pub/sub connection receives it;
* ``core layer``: the numbering call, then channels-redis ``RedisChannelLayer.group_send``
  to a group this process's layer channel is in, received with the layer's ``receive``
  (its public API, what the backplane did before it wrote the layer's format itself);
* ``pubsub layer``: the same through ``RedisPubSubChannelLayer``.

The paths alternate in rounds, so the machine's noise falls on each.

Usage:  REDIS_URL=redis://127.0.0.1:6379/0 python bench/publish_path.py [--count 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import progress

CHANNEL = "bench:path"
DATA = '{"n":1}'


async def backplane_path(url: str, prefix: str) -> tuple[Callable[[int], Awaitable[None]], Any]:
    from realtime_app.cluster.redis import RedisBackplane

    backplane = RedisBackplane(instance_id=f"bench-{prefix}", config={"KEY_PREFIX": prefix, "REDIS_URL": url})
    received = [0]

    async def deliver(_: object) -> None:
        received[0] += 1

    await backplane.start(deliver)
    await backplane.join([CHANNEL])

    async def run(n: int) -> None:
        target = received[0] + n
        for _ in range(n):
            await backplane.publish(CHANNEL, DATA)
        while received[0] < target:
            await asyncio.sleep(0.001)

    return run, backplane.stop


async def layer_path(layer: Any, url: str, prefix: str) -> tuple[Callable[[int], Awaitable[None]], Any]:
    """The numbering call of the backplane, then the layer's own group_send and receive."""
    from realtime_app.cluster.redis import RedisBackplane
    from realtime_app.wire.names import group_name
    from realtime_app.wire.protocol import notification_head, notification_tail

    numbering = RedisBackplane(instance_id=f"bench-n-{prefix}", config={"KEY_PREFIX": prefix, "REDIS_URL": url})
    channel = await layer.new_channel("bench.")
    group = group_name(CHANNEL)
    await layer.group_add(group, channel)

    async def run(n: int) -> None:
        for _ in range(n):
            seq = int(await numbering._seq(keys=[numbering.key("seq", CHANNEL)], args=[0, numbering.seq_ttl_ms]))
            text = notification_head(CHANNEL, DATA) + notification_tail(seq, 0)
            await layer.group_send(group, {"type": "realtime.frame", "channel": CHANNEL, "text": text, "seq": seq})
            await layer.receive(channel)

    async def stop() -> None:
        await layer.group_discard(group, channel)
        await numbering.stop()

    return run, stop


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    url = os.environ.get("REDIS_URL")
    if not url:
        sys.exit("set REDIS_URL (e.g. redis://127.0.0.1:6379/0)")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    logging.getLogger("realtime_app.backplane").setLevel(logging.ERROR)
    import redis
    from channels_redis.core import RedisChannelLayer
    from channels_redis.pubsub import RedisPubSubChannelLayer

    prefix = f"bench-{secrets.token_hex(3)}"
    paths = {
        "backplane (one call, pub/sub)": await backplane_path(url, prefix),
        "core layer group_send": await layer_path(
            RedisChannelLayer(hosts=[url], prefix=f"{prefix}:asgi", capacity=100_000), url, prefix
        ),
        "pubsub layer group_send": await layer_path(
            RedisPubSubChannelLayer(hosts=[url], prefix=f"{prefix}:ps"), url, prefix
        ),
    }
    cpu = dict.fromkeys(paths, 0.0)
    try:
        for round_ in range(args.rounds):
            for name, (run, _) in paths.items():
                start = time.process_time()
                await run(args.count)
                cpu[name] += time.process_time() - start
                progress(f"round {round_ + 1}/{args.rounds}, {name}")
    finally:
        for _, stop in paths.values():
            await stop()
        client = redis.Redis.from_url(url)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()
    n = args.count * args.rounds
    base = 1e6 * cpu["core layer group_send"] / n
    print(f"{'path':<32}{'µs CPU / publication':>22}{'vs core layer':>15}")
    for name, seconds in cpu.items():
        us = 1e6 * seconds / n
        print(f"{name:<32}{us:>22.0f}{us / base:>15.2f}")


if __name__ == "__main__":
    asyncio.run(main())
