"""Fan-out: every publication to the local subscribers of its channel, through each
connection's guard, encoded once (deltas, conflation and replays' buffers included).

What the guards decide is counted by :mod:`realtime_app.hub.outcomes`; answers to one
connection are :mod:`realtime_app.hub.replies`'.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from typing import TYPE_CHECKING, Any, Protocol

from realtime_app.conf.runtime import settings
from realtime_app.declarations.policies import frame_policy
from realtime_app.hub.connections import Connection
from realtime_app.hub.outcomes import Outcomes
from realtime_app.outbound.backpressure import HOLD, SEND, Decision
from realtime_app.outbound.transports import text_frame
from realtime_app.wire.deltas import ChannelDeltas, DeltaFrames
from realtime_app.wire.history import already_sent

if TYPE_CHECKING:
    from realtime_app.observability.schema import BackpressureProbe

__all__ = ["DRAIN_INTERVAL_S", "Fanout", "Held", "drain_held"]

logger = logging.getLogger("realtime_app.hub")

#: A live frame kept for a connection during its replay: ``(seq, epoch, payload)``.
Held = tuple[int, str, bytes]


_RULE: Any = object()  # "the channel's own rule": read from POLICIES where the frame is sent


def _rule(channel: str, policy: Any) -> str | None:
    """The backpressure rule a frame of ``channel`` is sent under: ``policy`` as its caller
    read it, or the channel's own rule. Conflation is :meth:`Fanout._conflate`'s alone: a
    single frame sent outside it follows the process's rule."""
    if policy is _RULE:
        policy = frame_policy(channel) if channel else None
    return None if policy == "conflate" else policy


class Fanout:
    """Sends each publication to the local subscribers of its channel."""

    def __init__(
        self,
        subscribers: dict[str, set[Connection]],
        connections: set[Connection],
        outcomes: Outcomes,
    ) -> None:
        self.subscribers = subscribers  # the hub's, per channel
        self.connections = connections
        self.outcomes = outcomes  # drops, 1013 closes and failed sends, shared with the replies
        #: Connections being given a channel's history: their live frames wait here meanwhile.
        self.buffers: dict[str, dict[Connection, list[Held]]] = {}
        self.frames_out = 0  # channel frames handed to guards (dropped ones included), cumulative
        self.channel_frames: dict[str, int] = {}  # publications fanned out here, per channel
        self.conflated = 0  # frames of conflated channels replaced by a newer one, never sent
        self.delta_subs: dict[str, set[Connection]] = {}  # channel -> its delta subscribers here
        self.deltas = ChannelDeltas()
        self.holding: set[Connection] = set()  # connections with conflated frames held back
        #: Set while ``holding`` is not empty: the drain loop sleeps on it, not on a timer.
        self.some_held = asyncio.Event()
        #: Connections that lagged since the probe last found them clear (their guards note
        #: them): the only ones a probe reads. An idle connection costs a probe nothing.
        self.watched: set[Connection] = set()
        #: Connections that dropped frames (found by the probe among the watched ones: a
        #: drop notes its connection), kept while open; and the most dropping of them as of
        #: the last probe.
        self.droppers: set[Connection] = set()
        self.top_droppers: list[Connection] = []

    def fanout(self, channel: str, text: str, seq: int = 0, epoch: str = "") -> None:
        """Hand one encoded frame to every local subscriber of ``channel``, guarded. A frame
        of a channel with history (``epoch``) goes to each connection once, in order, and
        after its replay."""
        subs = self.subscribers.get(channel)
        if not subs:
            return
        self.channel_frames[channel] = self.channel_frames.get(channel, 0) + 1
        payload = text.encode("utf-8")  # once per publication, not per subscriber
        frame = text_frame(payload)  # the same bytes on every subscriber's socket
        policy = frame_policy(channel)  # the channel's rule, read once per publication
        if epoch:
            replays = self.buffers.get(channel, {})
            built = self.deltas.frames(channel, text, seq) if self.delta_subs.get(channel) else None
            variants: dict[str, tuple[bytes, bytes]] = {}
            for conn in tuple(subs):
                buffer = replays.get(conn)
                if buffer is not None:
                    buffer.append((seq, epoch, payload))
                else:
                    self.push_kept(conn, channel, seq, epoch, payload, frame, built, variants, policy)
            return
        self.frames_out += len(subs)
        if policy == "conflate":  # a held frame may replace another: full frames only
            full = None
            if self.delta_subs.get(channel):
                data = self.deltas.full_only(channel, text).encode("utf-8")
                full = (data, text_frame(data))
            self._conflate(channel, subs, payload, frame, full)
            return
        if self.delta_subs.get(channel):
            self._with_deltas(channel, subs, text, seq, payload, frame, policy)
            return
        for conn in tuple(subs):
            try:
                decision = conn.guard.send(payload, frame=frame, policy=policy)
            except Exception as exc:
                self.outcomes.send_failed(conn, exc)
                continue
            if decision is not SEND:
                self.outcomes.account(conn, decision)

    def _with_deltas(
        self, channel: str, subs: set[Connection], text: str, seq: int, payload: bytes, frame: bytes, policy: str | None
    ) -> None:
        """A publication of a channel with delta subscribers: the frames built once (the
        plain one, the full text, the delta), each connection given the one it can use."""
        built = self.deltas.frames(channel, text, seq)
        variants: dict[str, tuple[bytes, bytes]] = {}
        for conn in tuple(subs):
            if channel in conn.deltas:
                self._send_delta(conn, channel, seq, built, variants, policy)
            else:
                self._guarded(conn, payload, frame, policy)

    def _send_delta(
        self,
        conn: Connection,
        channel: str,
        seq: int,
        built: DeltaFrames,
        variants: dict[str, tuple[bytes, bytes]],
        policy: str | None,
    ) -> None:
        """One publication to one delta subscriber: the delta when it received the base,
        else the full text; each variant encoded once per publication (``variants``)."""
        kind, text = (
            ("delta", built.delta)
            if built.delta is not None and conn.deltas[channel] == built.base_seq
            else ("full", built.full)
        )
        if kind not in variants:
            data = text.encode("utf-8")
            variants[kind] = (data, text_frame(data))
        body, raw = variants[kind]
        decision = self._guarded(conn, body, raw, policy)
        if decision is not None:
            conn.deltas[channel] = seq if decision is SEND else -1  # missed: a full frame next

    def want_deltas(self, conn: Connection, channel: str) -> bool:
        """``conn`` subscribed to ``channel`` with deltas: a full frame first. False (not
        granted) when it closed or left meanwhile — nothing is kept for it — or when the
        channel is conflated: a held frame replaces others, every frame goes whole."""
        if conn.closed or channel not in conn.subscriptions or frame_policy(channel) == "conflate":
            return False
        conn.deltas[channel] = -1
        self.delta_subs.setdefault(channel, set()).add(conn)
        return True

    def forget_deltas(self, conn: Connection, channel: str) -> None:
        """``conn`` left ``channel`` (or closed)."""
        conn.deltas.pop(channel, None)
        subs = self.delta_subs.get(channel)
        if subs is not None:
            subs.discard(conn)
            if not subs:
                del self.delta_subs[channel]
                self.deltas.forget(channel)

    def _conflate(
        self, channel: str, subs: set[Connection], payload: bytes, frame: bytes, full: tuple[bytes, bytes] | None
    ) -> None:
        """A frame of a conflated state channel: written, or held as the channel's newest
        for each connection over its threshold (:meth:`drain_held` writes it later). A
        delta subscriber gets the full text (``full``): what is held may replace another."""
        for conn in tuple(subs):
            guard = conn.guard
            before = guard.conflated
            body, raw = full if full is not None and channel in conn.deltas else (payload, frame)
            try:
                decision = guard.send_conflated(channel, body, raw)
            except Exception as exc:
                self.outcomes.send_failed(conn, exc)
                continue
            if decision is HOLD:
                self._hold(conn)
                self.conflated += guard.conflated - before

    def send_merged(self, conn: Connection, key: str, payload: bytes) -> Decision | None:
        """A frame that replaces ``key``'s frame still held for ``conn`` (its sender merged
        what the held one carried into it: presence diffs); written, or held until the
        queue drains. None: the send raised."""
        try:
            decision = conn.guard.send_conflated(key, payload)
        except Exception as exc:
            self.outcomes.send_failed(conn, exc)
            return None
        if decision is HOLD:
            self._hold(conn)
        return decision

    def _hold(self, conn: Connection) -> None:
        self.holding.add(conn)
        self.some_held.set()

    def drain_held(self) -> int:
        """Write the held frames of every connection whose queue drained; returns how many."""
        written = 0
        for conn in tuple(self.holding):
            guard = conn.guard
            if not conn.closed:
                try:
                    written += guard.flush_held()
                except Exception as exc:
                    self.outcomes.send_failed(conn, exc)
            if conn.closed or not guard.held:
                self.holding.discard(conn)
        return written

    def push(
        self, conn: Connection, payload: bytes, frame: bytes | None = None, channel: str = "", policy: Any = _RULE
    ) -> Decision | None:
        """One frame of ``channel`` to one connection, guarded under the channel's rule (as
        :meth:`fanout` does); to a delta subscriber as its full text (a replayed or
        held-back frame: the next live one is full too, whatever base the process kept).
        Returns what the guard decided (None: the send raised)."""
        if channel in conn.deltas:
            conn.deltas[channel] = -1
            payload = self.deltas.full_only(channel, payload.decode("utf-8")).encode("utf-8")
            frame = None
        self.frames_out += 1
        return self._guarded(conn, payload, frame if frame is not None else text_frame(payload), _rule(channel, policy))

    def _guarded(self, conn: Connection, payload: bytes, frame: bytes, policy: str | None = None) -> Decision | None:
        """One channel frame through ``conn``'s guard under ``policy`` (the channel's rule),
        what it decided accounted for; None when the send raised (that connection is
        closed). :meth:`fanout`'s plain loop does the same inline: the one place per
        subscriber per publication."""
        try:
            decision = conn.guard.send(payload, frame=frame, policy=policy)
        except Exception as exc:
            self.outcomes.send_failed(conn, exc)
            return None
        if decision is not SEND:
            self.outcomes.account(conn, decision)
        return decision

    def push_kept(
        self,
        conn: Connection,
        channel: str,
        seq: int,
        epoch: str,
        payload: bytes,
        frame: bytes | None = None,
        built: DeltaFrames | None = None,
        variants: dict[str, tuple[bytes, bytes]] | None = None,
        policy: Any = _RULE,
    ) -> None:
        """A frame of a channel with history, unless this connection had it already; a
        live one (``built``: its delta frames) to a delta subscriber as delta or full text;
        under the channel's rule (``policy``: read by the caller, else here)."""
        if already_sent(conn.positions.get(channel), epoch, seq):
            return
        conn.positions[channel] = (epoch, seq)
        if built is not None and variants is not None and channel in conn.deltas:
            self.frames_out += 1
            self._send_delta(conn, channel, seq, built, variants, _rule(channel, policy))
            return
        self.push(conn, payload, frame, channel, policy)

    def lagging(self, top: int) -> dict[Connection, int]:
        """Bytes queued now on each watched connection (one read each); those with nothing
        queued, nothing held and no drop balance leave the watch list. Updates
        :attr:`top_droppers` (the ``top`` open connections with the most drops)."""
        queued: dict[Connection, int] = {}
        for conn in list(self.watched):
            if conn.closed or conn not in self.connections:
                self.watched.discard(conn)
                continue
            guard = conn.guard
            if guard.state.drops:
                self.droppers.add(conn)
            now = guard.buffered()
            if now or guard.held or guard.state.balance:
                queued[conn] = now
            else:
                self.watched.discard(conn)
        self.droppers = {conn for conn in self.droppers if not conn.closed and conn in self.connections}
        self.top_droppers = heapq.nlargest(top, self.droppers, key=_drops) if top else []
        return queued

    def probe(self, queued: dict[Connection, int]) -> BackpressureProbe:
        """Queued bytes of the lagging connections (:meth:`lagging`). The others have none,
        or less than a quarter of the thresholds: a guard that knows its queue is that
        small does not read it (:meth:`~realtime_app.outbound.base.Transport.queued`)."""
        slow = settings().slow_consumer_bytes
        worst = total = slow_count = balance = 0
        for conn, amount in queued.items():
            total += amount
            worst = max(worst, amount)
            balance = max(balance, conn.guard.state.balance)
            if slow and amount >= slow:
                slow_count += 1
        return {
            "max_buffered_amount": worst,
            "max_drop_balance": balance,
            "total_buffered_amount": total,
            "slow_consumers": slow_count,
            "drops": self.outcomes.drops,
            "closes": self.outcomes.closes,
            "conflated": self.conflated,
            "holding": len(self.holding),
        }


def _drops(conn: Connection) -> tuple[int, int]:
    return (conn.guard.state.drops, -conn.id)


class HoldsFrames(Protocol):
    """What the drain loop needs of the hub: its fan-out."""

    fanout: Fanout


#: How often the conflated frames held back are offered to the connections that hold them.
DRAIN_INTERVAL_S = 0.05


async def drain_held(hub: HoldsFrames) -> None:
    """Write each conflated channel's newest frame once its connection's queue drains:
    a slow client converges to the latest state within this interval of its socket
    draining (there is no portable "drained" event across daphne and uvicorn). While
    nothing is held it waits for something to be: an idle process is not woken 20 times
    a second for nothing."""
    fanout = hub.fanout
    while True:
        if not fanout.holding:
            fanout.some_held.clear()
            await fanout.some_held.wait()
        await asyncio.sleep(DRAIN_INTERVAL_S)
        if fanout.holding:
            fanout.drain_held()
