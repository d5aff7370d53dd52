"""The physical reference: a bare ``websockets`` server broadcasting one frame per cadence.

Usage: ws_broadcast.py PORT INTERVAL_MS [PING_INTERVAL_S] (pings every 20 s by default,
the library's own, as daphne's and uvicorn's; the timeout three times the interval).
"""

import asyncio
import itertools
import json
import sys
import time

import websockets
from websockets.asyncio.server import broadcast, serve


async def main(port: int, interval_ms: int, ping_interval: float = 20) -> None:
    clients: set = set()

    async def handler(ws) -> None:
        clients.add(ws)
        try:
            await ws.wait_closed()
        finally:
            clients.discard(ws)

    async with serve(
        handler, "127.0.0.1", port, compression=None, ping_interval=ping_interval, ping_timeout=3 * ping_interval
    ):
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        for seq in itertools.count(1):
            params = {"channel": "ref", "data": {"n": seq}, "seq": seq, "ts": int(time.time() * 1000)}
            broadcast(clients, json.dumps({"jsonrpc": "2.0", "method": "message", "params": params}))
            deadline += interval_ms / 1000
            await asyncio.sleep(max(0, deadline - loop.time()))


if __name__ == "__main__":
    _ = websockets
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2]), *(float(a) for a in sys.argv[3:4])))
