"""The physical reference: a bare ``websockets`` server broadcasting one frame per cadence."""

import asyncio
import itertools
import json
import sys
import time

import websockets
from websockets.asyncio.server import broadcast, serve


async def main(port: int, interval_ms: int) -> None:
    clients: set = set()

    async def handler(ws) -> None:
        clients.add(ws)
        try:
            await ws.wait_closed()
        finally:
            clients.discard(ws)

    async with serve(handler, "127.0.0.1", port, compression=None):
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        for seq in itertools.count(1):
            params = {"channel": "ref", "data": {"n": seq}, "seq": seq, "ts": int(time.time() * 1000)}
            broadcast(clients, json.dumps({"jsonrpc": "2.0", "method": "message", "params": params}))
            deadline += interval_ms / 1000
            await asyncio.sleep(max(0, deadline - loop.time()))


if __name__ == "__main__":
    _ = websockets
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
