"""Answers to one connection — RPC responses, errors, notices — through its guard, and
the rule that stops running the requests of a connection that does not read its answers
(docs/admission.md): a reply path of its own, beside the fan-out of publications.
"""

from __future__ import annotations

from realtime_app.hub.connections import Connection
from realtime_app.hub.outcomes import Outcomes
from realtime_app.outbound.backpressure import CLOSE, DROP, SEND, Decision, decide_send
from realtime_app.outbound.guard import BACKPRESSURE_REASON
from realtime_app.outbound.transports import text_frame
from realtime_app.wire.protocol import CloseCode

__all__ = ["UNREAD_ANSWER_BYTES", "Replies"]

#: Answers a connection over its backpressure threshold may still be written before its
#: requests stop running (docs/admission.md): enough for a slow client's small calls.
UNREAD_ANSWER_BYTES = 64 * 1024


class Replies:
    """Sends one connection its answers; refuses the requests of one that does not read."""

    def __init__(self, outcomes: Outcomes) -> None:
        self.outcomes = outcomes
        self.unread_refused = 0  # requests not run: their connection does not read its answers

    def send_to(self, conn: Connection, text: str, *, response: bool = False) -> Decision:
        """Send one frame to one connection through its guard (RPC responses, errors)."""
        payload = text.encode("utf-8")
        try:
            decision = conn.guard.send(payload, response=response, frame=text_frame(payload))
        except Exception as exc:
            self.outcomes.send_failed(conn, exc)
            return CLOSE
        if decision is not SEND:
            if response and decision is DROP and conn.guard.never_drop_responses:
                conn.unread_bytes += len(payload)  # written all the same: it counts
            self.outcomes.account(conn, decision)
        return decision

    def unread_responses(self, conn: Connection) -> bool:
        """True when the requests of ``conn``'s next frame must not run: its queue is over
        the threshold *and* the answers written since it went over reach
        ``UNREAD_ANSWER_BYTES``. The client does not read; each such frame counts as a
        dropped frame toward its 1013. A client that is only slow still gets small answers
        through (the adaptive client's subscribe to a slower cadence, a ping), while what
        the server holds stays within the threshold plus that budget plus one answer,
        whatever the client sends."""
        guard = conn.guard
        if conn.closed:
            return True
        if not guard.measure:
            return False
        buffered = guard.buffered()
        if buffered <= guard.config.max_backpressure:
            conn.unread_bytes = 0
            return False
        if conn.unread_bytes < UNREAD_ANSWER_BYTES:
            return False
        decision = decide_send(buffered, guard.config, guard.state)
        self.unread_refused += 1
        if decision is CLOSE:
            guard.close(CloseCode.TRY_AGAIN_LATER, BACKPRESSURE_REASON)
        self.outcomes.account(conn, decision)
        return True
