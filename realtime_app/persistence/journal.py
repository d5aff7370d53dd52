"""The write-behind journal: what a store accepted and could not write when its process
ended, kept on disk for the next process to write.

A process that stops while its database is unreachable still holds changes it answered
"accepted" for. They are written here, one JSON file per store and process, in the
batches they would have been flushed in — each under its **batch token**
(:class:`~realtime_app.models.FlushMark`): a batch whose commit did happen before the
outage is found by its token and not applied twice. The next process to start takes each
file over (an atomic rename), writes its batches before anything newer, and deletes the
file once every batch in it is durable; if it stops before then, it journals them again.

The directory is ``WRITE_BEHIND_JOURNAL_DIR``: one every process of a host can read and
write, and that outlives a restart (a volume, not a container's scratch space).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.core.serializers.json import DjangoJSONEncoder

__all__ = ["JournalFile", "claim", "journal_dir", "write"]

logger = logging.getLogger("realtime_app.write_behind")

#: ``[(token, [(key, snapshot), ...]), ...]``: a store's unsaved batches.
Batches = list[tuple[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]]


def journal_dir() -> Path:
    """``WRITE_BEHIND_JOURNAL_DIR``, or ``<tmp>/realtime_app-journal`` when unset."""
    from realtime_app.conf import get_config

    configured = get_config()["WRITE_BEHIND_JOURNAL_DIR"]
    return Path(configured) if configured else Path(tempfile.gettempdir()) / "realtime_app-journal"


def _stem(store: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", store)


def write(store: str, batches: Batches, directory: Path | None = None) -> Path:
    """Write ``batches`` of ``store`` to a new journal file (atomically: a temporary file
    renamed into place, fsync'ed); returns its path. Raises ``OSError``."""
    directory = directory or journal_dir()
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{_stem(store)}.{os.getpid()}.{secrets.token_hex(4)}.json"
    body = {
        "store": store,
        "batches": [{"token": token, "items": [[list(key), snap] for key, snap in items]} for token, items in batches],
    }
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".writing-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(body, f, cls=DjangoJSONEncoder)
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


def claim(store: str, directory: Path | None = None) -> list[JournalFile]:
    """Take over every journal file of ``store``: files left by ended processes, and files
    another process took over but did not finish (it is no longer running). A file two
    processes race for goes to the one whose rename lands."""
    directory = directory or journal_dir()
    if not directory.is_dir():
        return []
    stem = _stem(store)
    claimed: list[JournalFile] = []
    for path in sorted(directory.iterdir()):
        name = path.name
        if not name.startswith(stem + "."):
            continue
        if name.endswith(".json"):
            pass
        elif ".claimed-" in name:
            owner = name.rsplit(".claimed-", 1)[1]
            if not owner.isdigit() or _alive(int(owner)) and int(owner) != os.getpid():
                continue
        else:
            continue
        base = name.split(".claimed-", 1)[0]
        target = directory / f"{base}.claimed-{os.getpid()}"
        try:
            os.rename(path, target)
        except OSError:
            continue  # another process took it first
        try:
            body = json.loads(target.read_text(encoding="utf-8"))
            batches: Batches = [
                (str(b["token"]), [(tuple(key), dict(snap)) for key, snap in b["items"]]) for b in body["batches"]
            ]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.error("journal %s cannot be read, left in place: %s", target, exc)
            continue
        claimed.append(JournalFile(target, batches))
    return claimed
