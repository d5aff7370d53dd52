"""A real PostgreSQL for the tests: the server ``REALTIME_TEST_PG_URL`` names (scripts/test
sets it: 127.0.0.1:5432 when one listens, else a private server from the pgserver wheel),
one database per run, dropped at the end; and a TCP proxy a fault test can cut or freeze."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from urllib.parse import urlparse, urlunparse

from tests.support.servers import ROOT, free_port


def server_url() -> str:
    """The PostgreSQL server of this run; a missing server fails the test (never skips)."""
    url = os.environ.get("REALTIME_TEST_PG_URL") or "postgres://postgres@127.0.0.1:5432/postgres"
    import psycopg

    try:
        psycopg.connect(_libpq(url), connect_timeout=5).close()
    except psycopg.Error as exc:
        raise RuntimeError(f"PostgreSQL at {url} does not answer ({exc}); scripts/test provides one") from None
    return url


def _libpq(url: str) -> str:
    return url.replace("postgres://", "postgresql://", 1)


def with_database(url: str, name: str) -> str:
    parsed = urlparse(url)
    return urlunparse(parsed._replace(path=f"/{name}"))


def with_port(url: str, port: int) -> str:
    parsed = urlparse(url)
    netloc = parsed.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    return urlunparse(parsed._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))


def create_database(url: str, name: str) -> str:
    import psycopg

    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return with_database(url, name)


def drop_database(url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(_libpq(url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def migrate(database_url: str) -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DATABASE_URL": database_url}
    for args in (["migrate", "--noinput", "-v", "0"], ["demo_setup"]):
        subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True, capture_output=True)


class TcpProxy:
    """127.0.0.1:port → target, in a thread; :meth:`cut` closes the listener and every
    connection (the database is unreachable), :meth:`restore` listens again.
    :attr:`drop_before`: bytes that, seen coming back from the target, cut every open
    connection instead of being forwarded (once; it is cleared) — a connection lost after
    the server did the work and before its answer arrived."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.drop_before: bytes | None = None
        self.dropped = 0
        self._frozen: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()

    def restore(self) -> TcpProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self._listener is not listener:  # accepted while being cut
                client.close()
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            for a, b, back in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pipe, args=(a, b, back), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, back: bool = False) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if source in self._frozen:
                    continue  # swallowed: the peer hears nothing, and nothing says so
                marker = self.drop_before
                if back and marker is not None and marker in data:
                    self.drop_before, self.dropped = None, self.dropped + 1
                    self._drop_connections()
                    return
                sink.sendall(data)
        for s in (source, sink):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _drop_connections(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def freeze(self) -> None:
        """The connections open now go silent without closing — what a NAT or a load
        balancer that dropped them does; new connections pass."""
        with self._lock:
            self._frozen |= self._sockets

    def cut(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):  # wakes the thread blocked in accept()
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        self._drop_connections()
