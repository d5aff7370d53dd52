"""The objects a write-behind store keeps: each one's state, what is not yet written
(counter deltas, changed fields, versions), and how a written batch settles it. No
database and no loop here: :mod:`.write_behind` drives it, :mod:`.sql` writes it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "Accepted",
    "Batch",
    "Entry",
    "Key",
    "WriteRefused",
    "adopt",
    "combine",
    "evictable",
    "residual",
    "settle",
    "snapshot",
    "unsettle",
]

Key = tuple[Any, ...]


@dataclass(slots=True)
class Entry:
    state: dict[str, Any] | None  # None: deleted
    in_db: bool  # the row exists as far as this process knows
    version: int = 0  # bumped by each mutation
    flushed: int = 0  # the version the last successful flush wrote
    deltas: dict[str, int | float] = field(default_factory=dict)  # counters: change not yet written
    changed: dict[str, int] = field(default_factory=dict)  # plain field -> version of its last change
    dirty_since: float | None = None  # monotonic time of the oldest unsaved change
    not_before: float = 0.0  # pushed back after an error
    error: str | None = None  # a permanent failure, reported
    durable: dict[str, Any] | None = None  # the row as last read or written (None: no row)
    saved_at: float | None = None  # wall time of the last write that covered this object
    waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)
    generation: int = 0  # bumped by each delete: what an older snapshot took is moot
    replace: bool = False  # deleted since the last write: the next one writes the whole row
    in_doubt: int = 0  # batches holding it whose outcome is not known yet
    stale: bool = False  # refused: read again from the database at the next use
    refused: tuple[int, int, str] | None = None  # the versions (after, up to] last refused, and why


Batch = list[tuple[Key, Entry, dict[str, Any]]]


class _Store(Protocol):
    async def _durable(self, key: Key, version: int) -> None: ...


class WriteRefused(Exception):
    """The database refused an object's unsaved changes for a reason that is not an outage
    (a constraint, a row that is gone and may not be made): they are dropped, and the
    object is read again from the database at its next use."""

    def __init__(self, store: str, key: Key, reason: str) -> None:
        super().__init__(f"store {store}: {key!r} refused by the database: {reason}")
        self.store, self.key, self.reason = store, key, reason


@dataclass(frozen=True, slots=True)
class Accepted:
    """A mutation accepted in memory: its ``state`` now; ``await durable()`` for the flush."""

    state: dict[str, Any] | None
    version: int
    _store: _Store
    _key: Key

    async def durable(self, timeout: float | None = None) -> None:
        """Wait until a flush has written this version (or a later one); raises
        :class:`WriteRefused` if the database refused it."""
        await asyncio.wait_for(self._store._durable(self._key, self.version), timeout)


def evictable(entries: dict[Key, Entry], over: int, keep: Key | None = None) -> list[Key]:
    """The ``over`` least recently used objects that are saved (``entries`` is in order
    of use): those with unsaved changes, in doubt, waited for or failing stay, however
    many there are, and ``keep``."""
    gone: list[Key] = []
    if over <= 0:
        return gone
    for key, entry in entries.items():
        if len(gone) >= over:
            break
        if key == keep:
            continue
        if entry.dirty_since is None and not entry.in_doubt and not entry.waiters and entry.error is None:
            gone.append(key)
    return gone


def snapshot(entry: Entry) -> dict[str, Any]:
    return {
        "version": entry.version,
        "state": None if entry.state is None else dict(entry.state),
        "deltas": dict(entry.deltas),
        "changed": dict(entry.changed),
        "in_db": entry.in_db,
        "generation": entry.generation,
        "replace": entry.replace,
    }


def residual(now: dict[str, Any], doubt: dict[str, Any] | None) -> dict[str, Any] | None:
    """What an object's snapshot ``now`` holds beyond the in-doubt batch snapshot ``doubt``
    of the same object (journaled apart, under its own token); None when nothing."""
    if doubt is None or now["generation"] != doubt["generation"]:
        return now  # deleted since: the whole row (or its delete) replaces it
    deltas = {}
    for name in set(now["deltas"]) | set(doubt["deltas"]):
        left = now["deltas"].get(name, 0) - doubt["deltas"].get(name, 0)
        if left:
            deltas[name] = left
    changed = {name: v for name, v in now["changed"].items() if doubt["changed"].get(name) != v}
    if not deltas and not changed:
        return None
    return {**now, "deltas": deltas, "changed": changed, "replace": False, "in_db": True}


def refresh(entry: Entry, row: dict[str, Any], counters: frozenset[str]) -> None:
    """Counters as the database holds them now (other processes' deltas included), plus
    this process's deltas not written yet; read while no flush of ``entry`` ran."""
    if entry.state is None or entry.replace or entry.in_doubt or not entry.in_db:
        return
    entry.durable = {**(entry.durable or entry.state), **{name: row[name] for name in counters}}
    for name in counters:
        entry.state[name] = row[name] + entry.deltas.get(name, 0)


def combine(before: dict[str, Any] | None, snap: dict[str, Any]) -> dict[str, Any]:
    """Two in-doubt snapshots of one object, oldest first, as one: their deltas summed,
    their field changes merged (a later generation replaces an earlier one)."""
    if before is None or before["generation"] != snap["generation"]:
        return snap
    deltas = dict(before["deltas"])
    for name, delta in snap["deltas"].items():
        deltas[name] = deltas.get(name, 0) + delta
    return {**snap, "deltas": deltas, "changed": {**before["changed"], **snap["changed"]}}


def unsettle(entry: Entry, snap: dict[str, Any]) -> None:
    """A batch holding ``snap`` of ``entry`` is refused while another of its batches is
    still in doubt: take off what this one held, and nothing else."""
    if entry.generation == snap["generation"]:  # else deleted since: its deltas are gone
        _take_off(entry, snap)


def _take_off(entry: Entry, snap: dict[str, Any]) -> None:
    """What ``snap`` held of ``entry``'s unsaved deltas and field changes, taken off: what
    changed since stays."""
    for name, delta in snap["deltas"].items():
        left = entry.deltas.get(name, 0) - delta
        if left:
            entry.deltas[name] = left
        else:
            entry.deltas.pop(name, None)
    for name, changed_at in snap["changed"].items():
        if entry.changed.get(name) == changed_at:
            del entry.changed[name]


def adopt(entry: Entry, row: dict[str, Any]) -> None:
    """An object held before its row existed, with nothing of its own to write: the row
    another process made is now its state."""
    entry.state = dict(row)
    entry.durable = dict(row)
    entry.in_db = True


def settle(entry: Entry, snap: dict[str, Any], row: dict[str, Any] | None, counters: frozenset[str]) -> bool:
    """A batch that held ``snap`` of ``entry`` is durable: take off what it wrote, keep
    what changed meanwhile, take the counters as the database holds them (``row``: other
    processes' deltas included) and wake who waited for it. True: a row was written
    (False: deleted)."""
    version = snap["version"]
    entry.in_doubt = max(0, entry.in_doubt - 1)
    if entry.generation == snap["generation"]:  # else deleted since: its deltas are gone
        _take_off(entry, snap)
        if snap["replace"]:
            entry.replace = False
    if snap["state"] is None:
        entry.in_db = False
        entry.durable = None
    else:
        entry.in_db = True
        durable = dict(entry.durable or snap["state"])
        durable.update({name: snap["state"][name] for name in snap["changed"]})
        if row is not None:
            durable.update({name: row[name] for name in counters})
        entry.durable = durable
    entry.saved_at = time.time()
    if row is not None and entry.state is not None and entry.generation == snap["generation"]:
        for name in counters:  # the database's value plus what is not yet written
            entry.state[name] = row[name] + entry.deltas.get(name, 0)
    entry.flushed = max(entry.flushed, version)
    entry.error = None
    entry.not_before = 0.0
    if entry.version == entry.flushed:
        entry.dirty_since = None
    else:
        entry.dirty_since = time.monotonic()  # changed during the flush: due again later
    still = []
    for wanted, future in entry.waiters:
        if wanted <= entry.flushed:
            if not future.done() and not future.get_loop().is_closed():
                future.set_result(None)
        else:
            still.append((wanted, future))
    entry.waiters = still
    return snap["state"] is not None
