"""Event history: what a channel with history keeps, and the rule that decides a resume.

A channel declared with ``event_channel(name, history_size=N, history_ttl_s=T)`` keeps
its last ``N`` publications, none older than ``T`` seconds, on the backplane, numbered by
``seq`` under an **epoch**: a token that changes whenever the history is lost (Redis
flushed or restarted empty, a key evicted), so that "nothing missed" and "history gone"
are never confused. A client that saw ``(epoch, seq)`` asks ``since`` it; the backplane
reads what followed, and :func:`plan_resume` decides whether that fills the gap.

Pure: no I/O, no Django (the embedded backplane's store is :mod:`realtime_app.cluster.memory`'s).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MAX_EPOCH_LENGTH",
    "PAGE",
    "PAGE_BYTES",
    "HistoryEntry",
    "HistoryPolicy",
    "HistoryRead",
    "Resume",
    "Since",
    "epoch_suffix",
    "follows",
    "new_epoch",
    "newer_epoch",
    "plan_resume",
    "already_sent",
]

#: Entries and bytes read from a history per round trip, whichever comes first: a long
#: replay never holds Redis (or the reading process) for long, whatever the events' size.
PAGE = 500
PAGE_BYTES = 256 * 1024

#: Longest epoch a client may send back (ours are 19 hex characters).
MAX_EPOCH_LENGTH = 64


def newer_epoch(epoch: str, than: str) -> bool:
    """True when ``epoch`` replaced ``than``: later by the time it names when both are
    ours (19 hex characters), else simply different (an epoch of another format)."""
    if len(epoch) == len(than) == 19 and _is_hex(epoch) and _is_hex(than):
        return epoch > than
    return epoch != than


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def epoch_suffix() -> str:
    """The random part of an epoch: 32 bits in hex."""
    return secrets.token_hex(4)


def new_epoch(now_ms: int | None = None) -> str:
    """A fresh epoch: the time it began in milliseconds (11 hex digits), then 32 random
    bits. Epochs of one channel order as strings, so a late frame of a history that was
    replaced is told from one of its successor (the Redis backplane takes Redis' clock)."""
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    return f"{ms:011x}{epoch_suffix()}"


@dataclass(frozen=True, slots=True)
class HistoryPolicy:
    """How much of a channel's past the backplane keeps: ``size`` publications, each for
    at most ``ttl_s`` seconds. ``durable``: publications made in a transaction go through
    the outbox (docs/transactions.md)."""

    size: int
    ttl_s: int
    durable: bool = False

    @property
    def ttl_ms(self) -> int:
        return self.ttl_s * 1000


@dataclass(frozen=True, slots=True)
class Since:
    """A client's position: the last ``seq`` it was given, under ``epoch``."""

    seq: int
    epoch: str

    @classmethod
    def parse(cls, value: Any) -> Since:
        """``{"seq": int >= 0, "epoch": str}`` → :class:`Since`; ``ValueError`` says what is wrong."""
        if not isinstance(value, dict):
            raise ValueError('"since" must be an object {"seq": int, "epoch": str}')
        seq, epoch = value.get("seq"), value.get("epoch")
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 2**53:
            raise ValueError('"since.seq" must be an integer >= 0')
        if not isinstance(epoch, str) or not 0 < len(epoch) <= MAX_EPOCH_LENGTH:
            raise ValueError(f'"since.epoch" must be a non-empty string of at most {MAX_EPOCH_LENGTH} characters')
        return cls(seq, epoch)


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    """One kept publication: its ``seq``, its server time and its encoded notification."""

    seq: int
    ts: int
    text: str


@dataclass(frozen=True, slots=True)
class HistoryRead:
    """What the backplane answered: the epoch, the channel's last ``seq`` (``top``), how
    many publications it keeps now (``size``) and the entries after the asked ``seq``
    (empty when not asked, or when they cannot fill the gap anyway)."""

    epoch: str
    top: int
    size: int = 0
    entries: list[HistoryEntry] = field(default_factory=list)
    created: bool = False  # this read started the channel's lineage (keys it made live)


@dataclass(frozen=True, slots=True)
class Resume:
    """The answer to ``since``: ``recovered`` and the entries to send, in order."""

    recovered: bool
    entries: list[HistoryEntry]
    reason: str = ""  # why not recovered: "epoch_changed", "too_old", "ahead"


def plan_resume(since: Since, read: HistoryRead, policy: HistoryPolicy, now_ms: int) -> Resume:
    """Whether the history can fill the gap after ``since``: the epoch is the same, no more
    than ``size`` were missed, and the first one missed is kept and younger than the TTL.
    ``read.entries`` is the first page of what follows; the replay reads on and checks
    that each page follows the last (:func:`follows`)."""
    if since.epoch != read.epoch:
        if since.seq == 0 and read.top == 0 and read.created:  # a lineage nothing was ever published on, lapsed
            return Resume(True, [])  # and started again by this read: nothing was missed
        return Resume(False, [], "epoch_changed")
    if since.seq > read.top:
        return Resume(False, [], "ahead")  # a position this history never gave out
    missed = read.top - since.seq
    if missed == 0:
        return Resume(True, [])
    entries = [e for e in read.entries if since.seq < e.seq <= read.top]
    if missed > policy.size or not entries or entries[0].seq != since.seq + 1:
        return Resume(False, [], "too_old")
    if entries[0].ts < now_ms - policy.ttl_ms:
        return Resume(False, [], "too_old")
    return Resume(True, entries)


def follows(entries: list[HistoryEntry], after: int) -> bool:
    """True when ``entries`` are ``after + 1``, ``after + 2``, … with no hole."""
    return all(entry.seq == after + 1 + i for i, entry in enumerate(entries))


def already_sent(at: tuple[str, int] | None, epoch: str, seq: int) -> bool:
    """Whether a connection whose position is ``at`` (``(epoch, seq)`` last sent) has had
    this frame: a replay sent it, or it arrives late (queued for this process before it
    left the channel and joined again, a publisher overtaken by another, a frame of the
    history a newer epoch replaced)."""
    if at is None:
        return False
    return seq <= at[1] if epoch == at[0] else not newer_epoch(epoch, at[0])
