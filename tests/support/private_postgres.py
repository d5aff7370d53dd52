"""A PostgreSQL server of a test's own, on a free port: the one a fault test may stop,
kill or restart (never the machine's). Debian's binaries (``pg_ctl``, ``initdb``) run as
the ``postgres`` user when the tests run as root (PostgreSQL refuses root); a machine
without them fails the test, never skips it."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile

from tests.support.servers import free_port


def bin_dir() -> str:
    """Where ``initdb`` and ``pg_ctl`` are."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if found:
        return os.path.dirname(found[-1])
    on_path = shutil.which("pg_ctl")
    if on_path:
        return os.path.dirname(on_path)
    raise RuntimeError("no PostgreSQL server binaries (pg_ctl, initdb): apt-get install postgresql")


class PrivatePostgres:
    """``initdb`` in a temporary directory, trust authentication, 127.0.0.1 only."""

    def __init__(self) -> None:
        self.port = free_port()
        self.root = tempfile.mkdtemp(prefix="rt-pg-")
        self.data = os.path.join(self.root, "data")
        self.bin = bin_dir()

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        command = list(args)
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, check=check, capture_output=True, timeout=120)

    def start(self) -> PrivatePostgres:
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")
        if not os.path.exists(self.data):
            self._run(f"{self.bin}/initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8")
        options = f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=40"
        self._run(f"{self.bin}/pg_ctl", "-D", self.data, "-w", "-o", options, "-l", f"{self.root}/log", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        """``fast``: a clean shutdown; ``immediate``: as a crash (recovery at the next start)."""
        self._run(f"{self.bin}/pg_ctl", "-D", self.data, "-w", "-m", mode, "stop", check=False)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def close(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
