"""CPU per publication on the Redis backplane: one call that numbers and sends vs the
numbering call followed by channels-redis' own ``group_send``.

One process, one ``RedisBackplane`` started on a real channels-redis layer, its own member
plus a plain one in the channel's group; each publication is also received by this
process (one ``BZPOPMIN``); the plain member's queue is emptied after each round. The two paths alternate in
rounds, so the machine's noise falls on both.

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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import progress


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
    from channels_redis.core import RedisChannelLayer

    from realtime_app.backplane_redis import RedisBackplane
    from realtime_app.names import group_name

    prefix = f"bench-{secrets.token_hex(3)}"
    layer = RedisChannelLayer(hosts=[url], prefix=f"{prefix}:asgi", capacity=100_000)
    backplane = RedisBackplane(layer=layer, config={"KEY_PREFIX": prefix})
    received = [0]

    async def deliver(_: object) -> None:
        received[0] += 1

    await backplane.start(deliver)
    await backplane.join(["bench:path"])
    await layer.group_add(group_name("bench:path"), "bench.plain")
    cpu = {True: 0.0, False: 0.0}
    try:
        for round_ in range(args.rounds):
            for inline in (True, False):
                backplane.inline_group_send = inline
                target = received[0] + args.count
                start = time.process_time()
                for _ in range(args.count):
                    await backplane.publish("bench:path", '{"n":1}')
                while received[0] < target:
                    await asyncio.sleep(0.001)
                cpu[inline] += time.process_time() - start
                await layer.connection(0).delete(f"{layer.prefix}bench.plain")
                progress(f"round {round_ + 1}/{args.rounds}, {'one call' if inline else 'two steps'}")
    finally:
        await backplane.stop()
        client = layer.connection(0)
        async for key in client.scan_iter(match=f"{prefix}*"):
            await client.delete(key)
        await layer.close_pools()
    n = args.count * args.rounds
    one, two = 1e6 * cpu[True] / n, 1e6 * cpu[False] / n
    print(f"numbering call, then the layer's group_send: {two:7.0f} µs of CPU per publication (received)")
    print(f"one call (numbers and sends):                {one:7.0f} µs of CPU per publication (received)")
    print(f"one call / two steps: {one / two:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
