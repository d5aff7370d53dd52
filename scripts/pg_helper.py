"""Small PostgreSQL chores for scripts/test and scripts/demo: ping a server, make sure a
database exists, or start and stop a private one from the pgserver wheel (a fresh machine
without PostgreSQL)."""

from __future__ import annotations

import sys


def ping(url: str) -> bool:
    import psycopg

    try:
        psycopg.connect(url.replace("postgres://", "postgresql://", 1), connect_timeout=2).close()
    except psycopg.Error:
        return False
    return True


def ensure(url: str) -> None:
    """Create the database ``url`` names unless it exists (on its server's ``postgres``)."""
    from urllib.parse import urlparse, urlunparse

    import psycopg

    parsed = urlparse(url.replace("postgres://", "postgresql://", 1))
    name = parsed.path.lstrip("/")
    with psycopg.connect(urlunparse(parsed._replace(path="/postgres")), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')
            print(f"==> created the database {name}")


def start(data_dir: str) -> str:
    """Start a private server in ``data_dir`` (it keeps running); return its URL.

    pgserver initialises the cluster (trust auth; as a system user of its own when run as
    root, which PostgreSQL refuses to be) and answers on a Unix socket only; the tests need
    TCP (a proxy in front of it), so it is restarted on a free loopback port.
    """
    import socket

    import pgserver  # type: ignore[import-not-found]
    from pgserver._commands import pg_ctl  # type: ignore[import-not-found]

    server = pgserver.get_server(data_dir, cleanup_mode=None)
    user = server.system_user
    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=user)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    socket_dir = server.pgdata
    options = ["-o", "-h 127.0.0.1", "-o", f"-p {port}", "-o", f"-k {socket_dir}"]
    pg_ctl(["-w", *options, "-l", str(server.log), "start"], pgdata=server.pgdata, user=user, timeout=60)
    return f"postgres://postgres@127.0.0.1:{port}/postgres"


def stop(data_dir: str) -> None:
    import pgserver  # type: ignore[import-not-found]
    from pgserver._commands import pg_ctl  # type: ignore[import-not-found]

    server = pgserver.get_server(data_dir, cleanup_mode=None)
    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user)


def main(argv: list[str]) -> int:
    command = argv[0]
    if command == "ping":
        return 0 if ping(argv[1]) else 1
    if command == "ensure":
        ensure(argv[1])
        return 0
    if command == "start":
        print(start(argv[1]))
        return 0
    if command == "stop":
        stop(argv[1])
        return 0
    print(f"unknown command {command!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
