"""The write-behind journal: what a store accepted and could not write when its process
ended, kept on disk for the next process to write.

A process that stops while its database is unreachable still holds changes it answered
"accepted" for. They are written here, one JSON file per store and process, in the
batches they would have been flushed in — each under its **batch token**
(:class:`~realtime_app.models.FlushMark`): a batch whose commit did happen before the
outage is found by its token and not applied twice. The next process to start takes each
file over (an atomic rename), writes its batches before anything newer, and deletes the
file once every batch in it is durable; if it stops before then, it journals them again.

**A journal only goes home.** Each file records the site it belongs to (its settings
module and a digest of its ``SECRET_KEY``, never the key) and the database (vendor, name,
host, port); a process of another site, or on another database, leaves it in place with
an ERROR. The directory is private to the site (``0700``, the process's own); a file that
is a symlink, is not the process user's or is open to others is refused, and a file that
cannot be read is moved aside (``*.malformed``) — each file on its own, the others are
taken over. Values go back through the model's fields (``Decimal``, dates come back as
they went in). A journal put back after it was written is not applied again: its batches'
tokens are kept for good.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

from realtime_app.conf.runtime import runtime

__all__ = ["JournalFile", "claim", "default_dir", "ensure_dir", "identity", "journal_dir", "problem", "write"]

logger = logging.getLogger("realtime_app.write_behind")

#: ``[(token, [(key, snapshot), ...]), ...]``: a store's unsaved batches.
Batches = list[tuple[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]]
#: ``decode(key, snapshot) -> (key, snapshot)``: values back through the model's fields.
Decode = Callable[[list[Any], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]

FORMAT = 2


class JournalEncoder(DjangoJSONEncoder):  # type: ignore[misc]  # django has no stubs here
    """Django's encoder, but a ``datetime`` or a naive ``time`` keeps its microseconds:
    Django's cuts them to milliseconds (ECMA-262), and a journaled value comes back as it
    went in."""

    def default(self, o: Any) -> Any:
        if isinstance(o, datetime.datetime) or (isinstance(o, datetime.time) and o.utcoffset() is None):
            return o.isoformat()
        return super().default(o)  # an aware time: refused, as Django refuses it (its offset would be lost)


def _site() -> dict[str, str]:
    from django.conf import settings

    key = hashlib.sha256(b"realtime_app.journal:" + str(settings.SECRET_KEY).encode()).hexdigest()[:16]
    return {"settings": str(getattr(settings, "SETTINGS_MODULE", "") or ""), "secret_key_digest": key}


def identity(model: Any) -> dict[str, Any]:
    """Whose a journal of ``model``'s store is: the site and the database it writes to."""
    from django.db import connections, router

    alias = router.db_for_write(model)
    vendor = connections[alias].vendor
    db = connections[alias].settings_dict
    name = str(db.get("NAME") or "")
    if vendor == "sqlite" and name and "memory" not in name:
        name = str(Path(name).resolve())
    host = str(db.get("HOST") or "").lower()
    if host in LOCAL_HOSTS:  # one server, however a process names it
        host = "localhost"
    port = str(db.get("PORT") or DEFAULT_PORTS.get(vendor, ""))
    database = {"vendor": vendor, "name": name, "host": host, "port": port}
    return {"site": _site(), "database": database}


#: Names of this host's own server (an empty HOST is its socket: the same server).
LOCAL_HOSTS = {"", "localhost", "127.0.0.1", "::1", "[::1]"}
DEFAULT_PORTS = {"postgresql": "5432", "mysql": "3306", "oracle": "1521"}


def default_dir() -> Path:
    """``$XDG_STATE_HOME`` (or ``~/.local/state``) ``/realtime_app/journal-<site>``: the
    process user's own, one per site (never a world-writable temporary directory)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    site = _site()
    digest = hashlib.sha256(f"{site['settings']}:{site['secret_key_digest']}".encode()).hexdigest()[:12]
    return Path(base) / "realtime_app" / f"journal-{digest}"


def journal_dir() -> Path:
    """``WRITE_BEHIND_JOURNAL_DIR``, or :func:`default_dir` when unset."""
    from realtime_app.conf.runtime import settings

    configured = settings().write_behind_journal_dir
    return Path(configured) if configured else default_dir()


def problem(directory: Path) -> str | None:
    """Why ``directory`` cannot hold journals (None: it can, or can be made): not a
    directory, not the process user's, open to others, not writable."""
    if directory.is_symlink():
        return f"{directory} is a symbolic link"
    if not directory.exists():
        parent = directory.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            return f"{directory} does not exist and cannot be made ({parent} is not a writable directory)"
        return None
    if not directory.is_dir():
        return f"{directory} is not a directory"
    info = directory.stat()
    if info.st_uid != os.geteuid():
        return f"{directory} belongs to another user (uid {info.st_uid})"
    if info.st_mode & 0o022:
        return f"{directory} is writable by other users (mode {stat.filemode(info.st_mode)}): make it 0700"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable"
    return None


def ensure_dir(directory: Path | None = None) -> Path:
    """The journal directory, made ``0700`` if need be; raises ``OSError`` saying why it
    cannot hold journals."""
    directory = directory or journal_dir()
    why = problem(directory)
    if why is None and not directory.exists():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        why = problem(directory)
    if why is not None:
        raise OSError(f"the write-behind journal directory is unusable: {why}")
    return directory


def _stem(store: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", store)


def write(store: str, batches: Batches, owner: dict[str, Any], directory: Path | None = None) -> Path:
    """Write ``batches`` of ``store`` to a new journal file of ``owner`` (:func:`identity`)
    — atomically: a private temporary file renamed into place, fsync'ed; returns its path.
    Raises ``OSError``."""
    directory = ensure_dir(directory)
    name = f"{_stem(store)}.{os.getpid()}.{secrets.token_hex(4)}.json"
    body = {
        "format": FORMAT,
        "store": store,
        **owner,
        "batches": [{"token": token, "items": [[list(key), snap] for key, snap in items]} for token, items in batches],
    }
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".writing-")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(body, f, cls=JournalEncoder)
            f.flush()
            os.fsync(f.fileno())
        path = directory / name
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


@dataclass
class JournalFile:
    """A journal file this process took over, and the batch tokens still to write."""

    path: Path
    batches: Batches

    @property
    def tokens(self) -> set[str]:
        return {token for token, _ in self.batches}

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unsafe(path: Path) -> str | None:
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != os.geteuid():
        return f"it belongs to another user (uid {info.st_uid})"
    if info.st_mode & 0o077:
        return f"other users may open it (mode {stat.filemode(info.st_mode)})"
    return None


def _read(path: Path, store: str, decode: Decode) -> tuple[dict[str, Any], Batches]:
    body = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("store") != store:
        raise ValueError(f"not a journal of store {store} in format {FORMAT}")
    owner = {"site": body.get("site"), "database": body.get("database")}
    batches: Batches = [
        (str(b["token"]), [decode(list(key), dict(snap)) for key, snap in b["items"]]) for b in body["batches"]
    ]
    return owner, batches


def claim(store: str, owner: dict[str, Any], decode: Decode, directory: Path | None = None) -> list[JournalFile]:
    """Take over every journal file of ``store`` that belongs to ``owner``: files left by
    ended processes, and files another process took over but did not finish (it is no
    longer running). A file two processes race for goes to the one whose rename lands.
    A foreign file is left in place, an unsafe one untouched and a malformed one moved
    aside, each with an ERROR; the others are taken over all the same."""
    directory = directory or journal_dir()
    if not directory.is_dir():
        return []
    why = problem(directory)
    if why is not None:
        logger.error("store %s: journals not taken over: %s", store, why)
        return []
    mine = re.compile(re.escape(_stem(store)) + r"\.\d+\.[0-9a-f]{8}\.json(\.claimed-\d+)?")
    claimed: list[JournalFile] = []
    for path in sorted(directory.iterdir()):
        name = path.name
        if not mine.fullmatch(name):  # another store's (``a.b`` is not ``a.b.c``), or aside
            continue
        if ".claimed-" in name:
            owner_pid = name.rsplit(".claimed-", 1)[1]
            if not owner_pid.isdigit() or _alive(int(owner_pid)) and int(owner_pid) != os.getpid():
                continue
        elif not name.endswith(".json"):
            continue
        try:
            unsafe = _unsafe(path)
        except FileNotFoundError:
            continue  # taken by a process starting beside this one
        if unsafe is not None:
            if runtime().first_time(str(path), family="journal refused"):
                logger.error("store %s: journal %s refused, left untouched: %s", store, path, unsafe)
            continue
        base = name.split(".claimed-", 1)[0]
        target = directory / f"{base}.claimed-{os.getpid()}"
        try:
            os.rename(path, target)
        except OSError:
            continue  # another process took it first
        try:
            theirs, batches = _read(target, store, decode)
        except Exception as exc:  # whatever a damaged file raises, it is set aside
            aside = directory / f"{base}.malformed"
            with contextlib.suppress(OSError):
                os.rename(target, aside)
            logger.error("store %s: journal %s cannot be read, moved aside to %s: %s", store, path, aside.name, exc)
            continue
        if theirs != owner:
            with contextlib.suppress(OSError):
                os.rename(target, directory / base)  # back in place: it is another site's
            if runtime().first_time(str(path), family="journal refused"):
                logger.error(
                    "store %s: journal %s belongs to another site or database (%s), not this one (%s): left in place",
                    store,
                    directory / base,
                    _describe(theirs),
                    _describe(owner),
                )
            continue
        claimed.append(JournalFile(target, batches))
    return claimed


def _describe(owner: dict[str, Any]) -> str:
    site = owner.get("site") or {}
    db = owner.get("database") or {}
    if not isinstance(site, dict) or not isinstance(db, dict):
        return "unknown"
    where = f"{db.get('host')}:{db.get('port')}" if db.get("host") else "local"
    return f"site {site.get('settings')}, {db.get('vendor')} database {db.get('name')!r} at {where}"
