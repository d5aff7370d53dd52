"""A publisher process of the cluster for the live tests: ``python -m tests.support.publisher
CHANNEL COUNT RATE [PAD]`` publishes ``{"i": 0..COUNT-1}`` (plus ``"pad"``: PAD bytes of
text) at RATE per second (0: as fast as it can) through a hub of its own, then prints
``done <first seq> <last seq>``."""

from __future__ import annotations

import asyncio
import sys


async def main(channel: str, count: int, rate: float, pad: int = 0) -> None:
    from realtime_app import apublish
    from realtime_app.hub import get_hub

    hub = await get_hub()
    loop = asyncio.get_running_loop()
    start = loop.time()
    first = last = 0
    try:
        for i in range(count):
            if rate:
                delay = start + i / rate - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            last = await apublish(channel, {"i": i, "pad": "x" * pad} if pad else {"i": i})
            first = first or last
            if i % 500 == 499:
                print(f"published {i + 1}", flush=True)
    finally:
        await hub.aclose()
    print(f"done {first} {last}", flush=True)


if __name__ == "__main__":
    import django

    django.setup()
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0))
