"""Real servers for the tests: daphne (or uvicorn) processes of the demo site, and logins.

Each server runs ``project.asgi:application`` with ``tests.settings`` in its own process,
on a free port, with a log file the test can show when it fails.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One server process on 127.0.0.1:port."""

    def __init__(
        self,
        env: dict[str, str],
        *,
        server: str = "daphne",
        port: int | None = None,
        extra_args: list[str] | None = None,
        app: str = "tests.asgi:application",
        bind_plain: bool = True,
    ) -> None:
        self.port = port or free_port()
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONUNBUFFERED": "1", **env}
        self.server = server
        self.extra_args = extra_args or []
        self.app = app
        self.bind_plain = bind_plain
        self.log = tempfile.NamedTemporaryFile(prefix=f"{server}-{self.port}-", suffix=".log", delete=False)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/realtime/"

    def start(self) -> Server:
        if self.server == "daphne":
            bind = ["-b", "127.0.0.1", "-p", str(self.port)] if self.bind_plain else []
            cmd = [sys.executable, "-m", "daphne", *bind, *self.extra_args, self.app]
        elif self.server == "gunicorn":  # WSGI, threads: Django's sync path
            bind = ["-b", f"127.0.0.1:{self.port}", "-w", "1", "--threads", "16"]
            cmd = [sys.executable, "-m", "gunicorn", *bind, *self.extra_args, "project.wsgi:application"]
        else:
            cmd = [
                sys.executable,
                "-m",
                "uvicorn",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--ws",
                "websockets-sansio",
                "--lifespan",
                "off",
                *self.extra_args,
                self.app,
            ]
        self.process = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.server} exited at start:\n{self.output()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"{self.server} did not listen within 30 s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up (a crash)."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


@contextlib.contextmanager
def servers(count: int, env: dict[str, str], **kwargs: object) -> Iterator[list[Server]]:
    started: list[Server] = []
    try:
        for _ in range(count):
            started.append(Server(env, **kwargs).start())  # type: ignore[arg-type]
        yield started
    finally:
        for s in started:
            s.stop()


def wait_listening(port: int, process: subprocess.Popen[bytes], timeout: float, log: Callable[[], str]) -> None:
    """Poll until something listens on 127.0.0.1:``port``; fail with ``log()`` if the
    process exits first or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on port {port}:\n{log()}")
        time.sleep(0.05)


def prepare_database(path: str) -> dict[str, str]:
    """Migrate an SQLite file and create the demo users; returns the env naming it."""
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DATABASE_URL": f"sqlite:///{path}"}
    for args in (["migrate", "--noinput", "-v", "0"], ["demo_setup"]):
        subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True, capture_output=True)
    return {"DATABASE_URL": f"sqlite:///{path}"}


def login(base_url: str, username: str, password: str, context: ssl.SSLContext | None = None) -> str:
    """Log in through the login form; returns the Cookie header for WebSocket handshakes."""
    jar = http.cookiejar.CookieJar()
    handlers: list[urllib.request.BaseHandler] = [urllib.request.HTTPCookieProcessor(jar)]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    opener.open(f"{base_url}/accounts/login/").read()
    csrf = next(c.value for c in jar if c.name == "csrftoken")
    data = urllib.parse.urlencode({"username": username, "password": password, "csrfmiddlewaretoken": csrf}).encode()
    request = urllib.request.Request(f"{base_url}/accounts/login/", data=data, headers={"Referer": base_url + "/"})
    opener.open(request).read()
    cookies = {c.name: c.value for c in jar}
    if "sessionid" not in cookies:
        raise AssertionError(f"login of {username} failed")
    return "; ".join(f"{k}={v}" for k, v in cookies.items())


def logout(base: str, cookie: str) -> int:
    csrf = dict(part.split("=", 1) for part in cookie.split("; "))["csrftoken"]
    request = urllib.request.Request(
        f"{base}/accounts/logout/",
        data=urllib.parse.urlencode({"csrfmiddlewaretoken": csrf}).encode(),
        headers={"Cookie": cookie, "Referer": base + "/"},
    )
    opener = urllib.request.build_opener(NoRedirect)
    try:
        return opener.open(request).status
    except urllib.error.HTTPError as error:
        return error.code


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def manage(env: dict[str, str], *args: str) -> str:
    """``manage.py`` with the test settings and ``env``: its output (a token, say)."""
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", **env},
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip()
