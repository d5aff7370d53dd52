"""Every write-behind store of this process: listed for the probe, started with the
server (taking over the journals ended processes left), flushed at its end — and what
cannot be written then, journaled for the next process."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

from realtime_app.conf.runtime import runtime
from realtime_app.observability.schema import StoreProbe

__all__ = [
    "Store",
    "flush_all",
    "install_shutdown_flush",
    "journal_problem",
    "register",
    "start_all",
    "store_probe",
    "stores",
    "stores_probe",
    "unregister",
]

logger = logging.getLogger("realtime_app.write_behind")


class _Entry(Protocol):
    @property
    def dirty_since(self) -> float | None: ...


class _Handover(Protocol):
    @property
    def journaled(self) -> int: ...
    @property
    def replayed(self) -> int: ...


class Store(Protocol):
    """What this module reads of a store (``WriteBehindStore``, which it does not import:
    the store registers itself here)."""

    name: str
    last_flush: dict[str, Any] | None
    consecutive_failures: int
    retries: int
    flushes: int
    flushed_rows: int
    flushed_deletes: int
    refused: int
    evicted: int

    @property
    def entries(self) -> Mapping[Any, _Entry]: ...
    @property
    def failing(self) -> Mapping[Any, Any]: ...
    @property
    def handover(self) -> _Handover: ...
    @property
    def delay_s(self) -> float: ...
    @property
    def in_doubt_rows(self) -> int: ...
    def for_exit(self) -> None: ...
    def problems(self) -> list[str]: ...
    def probe(self) -> StoreProbe: ...
    def start(self) -> None: ...
    def journal_unsaved(self) -> int: ...
    async def aflush_all(self) -> int: ...


#: The write-behind stores, in creation order: made at import time by the application's
#: modules (like its channels), so declared here, not runtime state — a runtime closed or
#: replaced still flushes them at the process's end.
_stores: list[Store] = []


class Stores:
    """Whether the stores' flush at a stop is hooked, and the journal directory as last
    looked at (a part of the runtime)."""

    def __init__(self) -> None:
        self.shutdown_installed = False
        self.atexit_installed = False
        #: (when, which directory, why it is unusable or None)
        self.journal_state: tuple[float, str, str | None] | None = None


def _book() -> Stores:
    return runtime().part(Stores)


def stores() -> list[Store]:
    """Every store of this process (the probe lists them)."""
    return list(_stores)


def register(store: Store) -> None:
    _stores.append(store)


def unregister(store: Store) -> None:
    if store in _stores:
        _stores.remove(store)


def store_probe(store: Store) -> StoreProbe:
    """One store's counters, read without deciding anything."""
    now = time.monotonic()
    dirty = [e for e in store.entries.values() if e.dirty_since is not None]
    oldest = max((now - e.dirty_since for e in dirty if e.dirty_since is not None), default=0.0)
    return {
        "objects": len(store.entries),
        "dirty": len(dirty),
        "oldest_unsaved_s": round(oldest, 3),
        "last_flush": store.last_flush,
        "consecutive_failures": store.consecutive_failures,
        "retries": store.retries,
        "flushes": store.flushes,
        "flushed_rows": store.flushed_rows,
        "flushed_deletes": store.flushed_deletes,
        "failing": dict(list(store.failing.items())[-10:]),
        "refused": store.refused,
        "in_doubt": store.in_doubt_rows,
        "delay_s": store.delay_s,
        "evicted": store.evicted,
        "journaled": store.handover.journaled,
        "replayed": store.handover.replayed,
    }


def stores_probe() -> dict[str, StoreProbe]:
    """Every store's counters (the probe's ``write_behind``)."""
    return {store.name: store.probe() for store in stores()}


#: How long a look at the journal directory is kept (readiness polls it every second).
JOURNAL_RECHECK_S = 10.0


def journal_problem(now: float | None = None) -> str | None:
    """Why this process's write-behind journal cannot be written (None: it can, or no
    store is registered): a process that cannot keep what it acknowledges reports not
    ready. Looked at again every :data:`JOURNAL_RECHECK_S`; logged as ERROR once when it
    breaks, INFO once when it is fixed."""
    book = _book()
    if not _stores:
        return None
    from realtime_app.persistence import journal

    now = time.monotonic() if now is None else now
    directory = journal.journal_dir()
    kept = book.journal_state
    if kept is not None and kept[1] == str(directory) and now - kept[0] < JOURNAL_RECHECK_S:
        return kept[2]
    why = journal.problem(directory)
    before = kept[2] if kept is not None and kept[1] == str(directory) else None  # another one: said anew
    book.journal_state = (now, str(directory), why)
    if why is not None and before is None:
        logger.error(
            "the write-behind journal directory is unusable, so changes accepted during a database outage "
            "would be lost at a stop; /realtime/ready answers 503 until it is fixed: %s "
            "(WRITE_BEHIND_JOURNAL_DIR; check E031)",
            why,
        )
    elif why is None and before is not None:
        logger.info("the write-behind journal directory is usable again; ready")
    return why


def _flush_at_exit() -> None:
    """A process ending without a server's shutdown (a management command, a script):
    write what is still dirty, on a loop of its own."""
    if not any(e.dirty_since is not None for store in stores() for e in store.entries.values()):
        return
    import os

    for store in stores():
        store.for_exit()
    # The database is called from the (only) thread left, inside the loop that drives the
    # flush: nothing else runs at this point, so Django's async-safety guard is lifted.
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        written = asyncio.run(flush_all())
        logger.info("exit: %d object(s) flushed", written)
    except Exception:
        logger.exception("exit: the final flush failed")


def install_shutdown_flush() -> None:
    """Flush every store when the server shuts down. Daphne has no ASGI lifespan: hook
    Twisted's shutdown (SIGTERM and SIGINT stop the reactor; the flush runs before). Under
    uvicorn, route ``lifespan`` to :func:`realtime_app.lifespan.lifespan_app` instead."""
    import atexit
    import sys

    book = _book()
    if not book.atexit_installed:
        book.atexit_installed = True
        atexit.register(_flush_at_exit)

    if book.shutdown_installed or "twisted.internet.reactor" not in sys.modules:
        return
    from twisted.internet import defer, reactor

    if not getattr(reactor, "running", False):
        return
    book.shutdown_installed = True

    def before_shutdown() -> Any:
        return defer.Deferred.fromFuture(asyncio.ensure_future(flush_all()))

    reactor_: Any = reactor
    reactor_.addSystemEventTrigger("before", "shutdown", before_shutdown)


async def flush_all() -> int:
    """Flush every store of this process (shutdown, the end of a command); what cannot be
    written goes to the journal for the next process (:mod:`realtime_app.persistence.journal`)."""
    written = 0
    for store in stores():
        try:
            written += await store.aflush_all()
        except Exception:
            logger.exception("store %s: final flush failed", store.name)
        try:
            store.journal_unsaved()
        except Exception:  # one store's failure is not every other store's loss
            logger.exception("store %s: its unsaved changes could not be journaled", store.name)
    return written


def start_all() -> None:
    """Start every store's flush loop on the running loop, taking over journals (a
    server's start: the hub's, the ASGI lifespan's)."""
    journal_problem()  # said at once, not first at the stop that loses the changes
    for store in stores():
        store.start()
