"""A store's side of the journal (:mod:`.journal`): taking over what ended processes
could not write, and handing over what this one cannot, when it ends."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Protocol

from realtime_app.observability.logsafe import safe
from realtime_app.persistence import journal
from realtime_app.persistence.entries import Batch, Entry, Key, combine, residual, snapshot
from realtime_app.persistence.journal import JournalFile

__all__ = ["Handover"]

logger = logging.getLogger("realtime_app.write_behind")

#: Objects per journaled batch of changes that were in no batch yet.
JOURNAL_BATCH = 50


class _Table(Protocol):
    model: Any

    def decode(self, key: list[Any], snap: dict[str, Any]) -> tuple[Key, dict[str, Any]]: ...


class Handover:
    """The journal files one store took over, and what it journaled and replayed."""

    def __init__(self, name: str, table: _Table) -> None:
        self.name = name
        self.table = table
        self.journals: list[JournalFile] = []  # taken over, not yet all written
        self.journaled = 0  # objects written to a journal at the end of this process
        self.replayed = 0  # objects taken over from journals

    @property
    def tokens(self) -> set[str]:
        """The batch tokens of the journals taken over and not yet all written."""
        return {token for file in self.journals for token in file.tokens}

    def take_over(self, entries: dict[Key, Entry], in_doubt: list[tuple[str, Batch]], delay_s: float) -> None:
        """Journaled batches become in-doubt batches under their own tokens, written before
        anything newer (a batch that did commit is found by its token, not applied again)."""
        try:
            claimed = journal.claim(self.name, journal.identity(self.table.model), self.table.decode)
        except OSError as exc:
            logger.error("store %s: the journal cannot be read: %s", self.name, exc)
            return
        now = time.monotonic()
        for file in claimed:
            for token, items in file.batches:
                batch: Batch = []
                for key, snap in items:
                    entry = entries.get(key)
                    if entry is None:
                        entry = entries[key] = Entry(state=None, in_db=bool(snap["in_db"]))
                    entry.version += 1
                    snap = {**snap, "version": entry.version, "generation": entry.generation}
                    snap["changed"] = {name: entry.version for name in snap["changed"]}
                    entry.state = None if snap["state"] is None else dict(snap["state"])
                    for name, delta in snap["deltas"].items():
                        entry.deltas[name] = entry.deltas.get(name, 0) + delta
                    entry.changed.update(snap["changed"])
                    entry.replace = entry.replace or bool(snap["replace"])
                    entry.in_doubt += 1
                    entry.dirty_since = now - delay_s  # due now
                    batch.append((key, entry, snap))
                    self.replayed += 1
                in_doubt.append((token, batch))
            self.journals.append(file)
            logger.warning(
                "store %s: %d object(s) taken over from %s, written before anything newer",
                self.name,
                sum(len(items) for _, items in file.batches),
                file.path,
            )

    def settle(self, in_doubt: list[tuple[str, Batch]]) -> None:
        """Delete the journal files taken over whose every batch is written."""
        pending = {token for token, _ in in_doubt}
        for file in list(self.journals):
            if not file.tokens & pending:
                file.remove()
                self.journals.remove(file)

    def hand_over(self, entries: dict[Key, Entry], in_doubt: list[tuple[str, Batch]]) -> int:
        """The process is ending: write what is still unsaved to a journal for the next
        process (the batches in doubt under their tokens, the rest under new ones); returns
        the objects kept, each then forgotten here. An ERROR says how many changes are lost
        if even that fails."""
        batches: list[tuple[str, list[tuple[Key, dict[str, Any]]]]] = []
        covered: dict[Key, dict[str, Any]] = {}  # every in-doubt snapshot of each key, as one
        for token, batch in in_doubt:
            batches.append((token, [(key, snap) for key, _, snap in batch]))
            for key, _, snap in batch:
                covered[key] = combine(covered.get(key), snap)
        rest = []
        for key, entry in entries.items():
            if entry.dirty_since is None:
                continue
            left = residual(snapshot(entry), covered.get(key))
            if left is not None:
                rest.append((key, left))
        for i in range(0, len(rest), JOURNAL_BATCH):
            batches.append((uuid.uuid4().hex, rest[i : i + JOURNAL_BATCH]))
        objects = sum(len(items) for _, items in batches)
        if not objects:
            self.remove_taken_over()
            return 0
        try:
            path = journal.write(self.name, batches, journal.identity(self.table.model))
        except Exception as exc:  # a disk, a directory, or a value JSON cannot carry
            logger.error(
                "store %s: %d accepted object(s) LOST: the database and the journal both failed (%s)",
                self.name,
                objects,
                safe(exc, 200),
            )
            return 0
        self.remove_taken_over()  # what they held is in the new file
        in_doubt.clear()
        for entry in entries.values():  # handed over: never journaled (or written) twice
            if entry.dirty_since is not None or entry.in_doubt:
                entry.dirty_since, entry.in_doubt = None, 0
                entry.deltas.clear()
                entry.changed.clear()
        self.journaled += objects
        logger.warning(
            "store %s: %d object(s) not written to the database, kept in %s for the next process",
            self.name,
            objects,
            path,
        )
        return objects

    def remove_taken_over(self) -> None:
        for file in self.journals:
            file.remove()
        self.journals.clear()
