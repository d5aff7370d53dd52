"""``python -m realtime_app.client URL CHANNEL``: watch a channel from a terminal."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from realtime_app.client.adaptive_channel import bind_adaptive_channel
from realtime_app.client.connection import RealtimeClient
from realtime_app.exceptions import RPCError

__all__ = ["main"]


async def _cli(args: argparse.Namespace) -> int:
    headers = {"Cookie": args.cookie} if args.cookie else {}
    client = RealtimeClient(args.url, origin=args.origin, headers=headers)
    client.on_state.append(lambda state: print(f"# {state}", file=sys.stderr))
    count = 0
    done = asyncio.Event()

    def show(params: dict[str, Any]) -> None:
        nonlocal count
        count += 1
        data = json.dumps(params.get("data"), separators=(",", ":"))
        print(f"{params.get('channel')}\tseq={params.get('seq')}\t{data[:200]}", flush=True)
        if args.count and count >= args.count:
            done.set()

    await client.connect()
    try:
        if args.adaptive:
            base, _, digits = args.channel.rpartition(":")
            if not (digits.isascii() and digits.isdigit()):
                base, digits = args.channel, str(args.interval)
            bound = await bind_adaptive_channel(client, base, int(digits), show)
            bound.on_change.append(lambda d, ms: print(f"# cadence {d}: {ms} ms", file=sys.stderr))
        else:
            print(f"# {await client.subscribe(args.channel, show)}", file=sys.stderr)
        await done.wait()
    except RPCError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        await client.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m realtime_app.client", description="Watch a realtime channel.")
    parser.add_argument("url", help="ws://host:port/realtime/")
    parser.add_argument("channel", help="e.g. demo:clock or demo:clock:2000")
    parser.add_argument("--adaptive", action="store_true", help="follow the family at the cadence you can absorb")
    parser.add_argument("--interval", type=int, default=1000, help="desired cadence with --adaptive on a bare base")
    parser.add_argument("--cookie", help="Cookie header (a Django session) for guarded channels")
    parser.add_argument("--origin", help="Origin header (default: the URL's host)")
    parser.add_argument("--count", type=int, default=0, help="stop after this many frames (0: never)")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(_cli(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
