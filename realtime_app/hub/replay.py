"""Subscribing to a channel with history, and resuming it after a gap.

The publications after the client's position are sent first, in order, then the live
ones, none twice: live frames that arrive meanwhile wait in a buffer for that connection
and go out after the replay, those the replay carried skipped. The replay is read a page
at a time, each page after the first paid from the reader's bucket, and paced by the
connection's send queue (docs/recovery.md). The rules — :func:`~realtime_app.wire.history.already_sent` and
:func:`pace` — are pure; :class:`Replays` carries them out.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from realtime_app.cluster.roles import HistoryStore, now_ms
from realtime_app.conf.runtime import settings
from realtime_app.declarations.registry import ChannelSpec
from realtime_app.exceptions import BackplaneUnavailable, RPCError
from realtime_app.hub.connections import Connection
from realtime_app.hub.envelope import publication_limit
from realtime_app.hub.fanout import Fanout, Held
from realtime_app.hub.ordering import Ordering
from realtime_app.hub.shares import ShareBook, lineage_bytes
from realtime_app.inbound.admission import Admission
from realtime_app.outbound.guard import Guard
from realtime_app.wire.deltas import FOSSIL
from realtime_app.wire.history import PAGE, PAGE_BYTES, HistoryEntry, Since, follows, plan_resume
from realtime_app.wire.protocol import OVERLOADED

__all__ = ["Replays", "calm_bytes", "pace"]

#: How long a replay may wait for a slow client to read (docs/recovery.md), and how many
#: live frames may wait for it meanwhile; past either, the resume answers ``too_slow``.
REPLAY_TIMEOUT_S = 10.0
REPLAY_MEASURE_BYTES = 64 * 1024
MAX_REPLAY_BUFFER = 10_000
#: How often a replay waiting for a calm queue looks at it again.
REPLAY_POLL_S = 0.02
#: Tokens a resume pays for each page of history it reads after the first, and when a
#: resume refused for ``MAX_CONCURRENT_RESUMES`` may come back.
RESUME_PAGE_COST = 1.0
RESUME_RETRY_MS = 1000
#: A resume at most this many publications from where this process is on its channel,
#: all within one read, costs what a subscribe and that read cost: it is not queued behind
#: ``MAX_CONCURRENT_RESUMES`` (:meth:`Replays.short`; the identity's
#: ``MAX_RESUMES_PER_IDENTITY`` still counts it). After a deploy every client of a stopped
#: process resumes a few seconds' worth.
SHORT_RESUME = 64


@dataclass(slots=True)
class Slot:
    """Whether a resume holds one of the process's ``MAX_CONCURRENT_RESUMES`` slots (a
    short one takes none, unless its read shows it is long after all)."""

    taken: bool = False


class Subscriptions(Protocol):
    """What a replay needs of the hub: its subscriptions and its view of each channel."""

    @property
    def backplane(self) -> HistoryStore | None: ...

    subscribers: dict[str, set[Connection]]
    last_seq: dict[str, int]
    shares: ShareBook

    async def subscribe(self, conn: Connection, spec: ChannelSpec) -> bool: ...

    def undo_subscribe(self, conn: Connection, channel: str) -> None: ...


def calm_bytes(guard: Guard) -> int:
    """What a connection's queue may hold for a replay to send on: half the backpressure
    threshold (a client that just had frames dropped is not dropped again)."""
    return int(guard.config.max_backpressure) // 2


def pace(*, queued: int, calm: int, held: int, now: float, deadline: float) -> Literal["send", "wait", "too_slow"]:
    """Whether a replay sends its next frame: when the connection's queue is under
    ``calm`` bytes (half the backpressure threshold: a client that just had frames
    dropped gets its replay as fast as it reads, not dropped again); past ``deadline``
    or with more than ``MAX_REPLAY_BUFFER`` live frames ``held`` for it, it gives up."""
    if queued <= calm:
        return "send"
    if now > deadline or held > MAX_REPLAY_BUFFER:
        return "too_slow"
    return "wait"


class Replays:
    """The replays in progress in this process, their buffers and their counters."""

    def __init__(self, hub: Subscriptions, fanout: Fanout, ordering: Ordering, admission: Admission) -> None:
        self.hub = hub
        self.fanout = fanout
        self.ordering = ordering
        self.admission = admission  # each page after the first is paid from its buckets
        self.buffers = fanout.buffers  # per channel, per connection being replayed
        self.recoveries: dict[str, int] = {"served": 0, "failed": 0, "deferred": 0}
        self.resuming = 0  # resumes replaying now, the short ones left out (MAX_CONCURRENT_RESUMES)
        self.resuming_by: dict[tuple[str, str] | None, int] = {}  # per identity (MAX_RESUMES_PER_IDENTITY)
        self.replayed = 0  # publications sent again from a history

    async def subscribe_kept(
        self, conn: Connection, spec: ChannelSpec, since: Since | None = None, deltas: bool = False
    ) -> dict[str, Any]:
        """Subscribe ``conn`` to a channel with history — or resume it, with ``since``.
        Returns the channel's position ``{"epoch", "seq"}`` and, with ``since``,
        ``recovered`` and ``replayed``, or ``reason`` when the gap was not filled;
        ``delta`` when ``deltas`` were asked for and granted (replayed frames go whole)."""
        who = conn.identity
        slot = Slot()
        if since is not None:
            # one identity's share first: an address pipelining resumes into a socket it
            # never reads holds its own slots, not every other client's
            self._refuse_past(settings().max_resumes_per_identity, self.resuming_by.get(who, 0))
            if not self.short(conn, spec, since):
                self._take(slot)
            self.resuming_by[who] = self.resuming_by.get(who, 0) + 1
        try:
            return await self._subscribe_kept(conn, spec, since, deltas, slot)
        finally:
            if since is not None:
                self.resuming -= int(slot.taken)
                left = self.resuming_by.pop(who, 1) - 1
                if left:
                    self.resuming_by[who] = left

    def short(self, conn: Connection, spec: ChannelSpec, since: Since) -> bool:
        """Whether a resume costs what a subscribe and one read cost: within
        ``SHORT_RESUME`` publications of where this process is on the channel (unknown
        here: not short), all of which fit one read (``SHORT_RESUME`` times the channel's
        bound on a publication within ``PAGE_BYTES``: with ``MAX_PUBLICATION_BYTES`` alone,
        never), to a socket whose queue is calm (at most half ``MAX_BACKPRESSURE``: its first
        frame does not wait)."""
        top = self.hub.last_seq.get(spec.name, 0)
        if top <= 0 or abs(top - since.seq) > SHORT_RESUME:
            return False
        limit, _ = publication_limit(spec)
        if not limit or SHORT_RESUME * limit > PAGE_BYTES:
            return False
        guard = conn.guard  # calm as a replay's first frame reads it (nothing measured: calm)
        return not guard.measure or guard.buffered() <= calm_bytes(guard)

    def _refuse_past(self, limit: int, taken: int) -> None:
        if limit and taken >= limit:
            self.recoveries["deferred"] += 1
            raise RPCError(
                OVERLOADED, "Too many resumes", "too_many_resumes", limit=limit, retry_after_ms=RESUME_RETRY_MS
            )

    def _take(self, slot: Slot) -> None:
        """One of the process's ``MAX_CONCURRENT_RESUMES`` slots, or -32003 too_many_resumes."""
        self._refuse_past(settings().max_concurrent_resumes, self.resuming)
        self.resuming += 1
        slot.taken = True

    async def _subscribe_kept(
        self, conn: Connection, spec: ChannelSpec, since: Since | None, deltas: bool, slot: Slot
    ) -> dict[str, Any]:
        hub = self.hub
        policy, backplane = spec.history, hub.backplane
        assert policy is not None and backplane is not None
        channel = spec.name
        buffer: list[Held] = []
        self.buffers.setdefault(channel, {})[conn] = buffer
        added = False
        try:
            added = await hub.subscribe(conn, spec)
            granted = deltas and self.fanout.want_deltas(conn, channel)  # before any frame
            read = await backplane.history(channel, policy, since, hub.last_seq.get(channel, 0))
            if read.created and conn.owner is not None:  # keys this subscribe made live: its identity's
                hub.shares.stored_by(conn.owner, lineage_bytes(channel), max(policy.ttl_ms, 1000))
            if channel in hub.subscribers:
                self.ordering.read(channel, read.epoch, read.top)
            at = conn.positions.get(channel)
            if at is None or at[0] != read.epoch or at[1] < read.top:
                conn.positions[channel] = (read.epoch, read.top)  # the replay brings it there
            answer: dict[str, Any] = {"epoch": read.epoch, "seq": read.top}
            if deltas:
                answer["delta"] = FOSSIL if granted else False
            if since is None:
                return answer
            plan = plan_resume(since, read, policy, now_ms())
            if plan.recovered and not slot.taken and read.top - since.seq > SHORT_RESUME:
                self._take(slot)  # this process was behind its channel: a long replay after all
            reason, sent = plan.reason, 0
            if plan.recovered:
                sent, reason = await self._replay(conn, channel, plan.entries, since.seq, read.top, buffer)
            answer["recovered"] = not reason
            if reason:
                self.recoveries["failed"] += 1
                answer["reason"] = reason
            else:
                self.recoveries["served"] += 1
                answer["replayed"] = sent
            return answer
        except backplane.errors as exc:
            backplane.outage.failed(exc)
            # A first subscribe is undone (it is told it failed); a resume keeps the
            # subscription: frames go on and the client resumes again at the next one.
            if added and since is None:
                hub.undo_subscribe(conn, channel)
            buffer.clear()
            raise BackplaneUnavailable("history", exc) from exc
        except BaseException:  # a bug or a cancel: never a half-done subscription
            if added:
                hub.undo_subscribe(conn, channel)
            buffer.clear()
            raise
        finally:
            self._end(conn, channel, buffer)

    async def _replay(
        self, conn: Connection, channel: str, entries: list[HistoryEntry], after: int, top: int, buffer: list[Held]
    ) -> tuple[int, str]:
        """Send the publications ``after`` .. ``top``: ``(sent, "")``, or why it stopped.
        Pages are read as they are needed; the queue is measured every 64 KiB sent."""
        backplane = self.hub.backplane
        assert backplane is not None
        guard = conn.guard
        calm = calm_bytes(guard)
        deadline = time.monotonic() + REPLAY_TIMEOUT_S
        sent = 0
        # measured often enough that what is sent between two reads stays under the
        # threshold (a small MAX_BACKPRESSURE, say 64 KiB, was overrun: the replay dropped)
        every = min(REPLAY_MEASURE_BYTES, max(calm // 2, 1))
        unmeasured = every + 1  # the first frame waits for a calm queue
        while after < top:
            if not entries:
                if not await self._pay_page(conn, deadline):
                    return sent, "too_slow"
                entries = await backplane.history_page(channel, after, PAGE)
            entries = [e for e in entries if e.seq <= top]
            if not entries or not follows(entries, after):
                return sent, "too_old"  # trimmed while it was read
            for entry in entries:
                payload = entry.text.encode("utf-8")
                unmeasured += len(payload)
                if unmeasured > every and guard.measure:
                    unmeasured = 0
                    while not conn.closed:
                        step = pace(
                            queued=guard.buffered(),
                            calm=calm,
                            held=len(buffer),
                            now=time.monotonic(),
                            deadline=deadline,
                        )
                        if step == "send":
                            break
                        if step == "too_slow":
                            return sent, "too_slow"
                        await asyncio.sleep(REPLAY_POLL_S)  # the transports signal no drain
                if conn.closed or channel not in conn.subscriptions:
                    return sent, "closed"
                self.fanout.push(conn, payload, channel=channel)
                sent += 1
                self.replayed += 1
            after = entries[-1].seq
            entries = []
        return sent, ""

    async def _pay_page(self, conn: Connection, deadline: float) -> bool:
        """A page after the first costs its reader ``RESUME_PAGE_COST`` tokens of its
        identity's bucket in this process: a resume costs what it replays, and one that
        outruns its bucket waits for it (False past ``deadline``)."""
        if conn.identity is None:
            return True
        while (refusal := self.admission.charge(conn.identity, RESUME_PAGE_COST)) is not None:
            wait = refusal.retry_after_ms / 1000
            if time.monotonic() + wait > deadline or conn.closed:
                return False
            await asyncio.sleep(wait)
        return True

    def _end(self, conn: Connection, channel: str, buffer: list[Held]) -> None:
        """Send what arrived live during a replay, in ``seq`` order, what it held skipped."""
        replays = self.buffers.get(channel)
        if replays is not None:
            replays.pop(conn, None)
            if not replays:
                del self.buffers[channel]
        for seq, epoch, payload in sorted(buffer, key=lambda item: (item[1], item[0])):
            if conn.closed or channel not in conn.subscriptions:
                return
            self.fanout.push_kept(conn, channel, seq, epoch, payload)
