"""The answer to one frame of requests: sent at once when every request is done, else
when the last queued one is (a batch gets one array, in request order)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from realtime_app.wire import protocol
from realtime_app.wire.protocol import Response

__all__ = ["Pending", "Reply"]


@dataclass(frozen=True, slots=True)
class Pending:
    """A queued request's answer to come: ``future`` gives ``(ok, result or error)``."""

    id: Any
    future: asyncio.Future[Any]

    def response(self) -> Response:
        ok, outcome = self.future.result()
        if ok:
            return protocol.result_response(self.id, outcome)
        return {"jsonrpc": "2.0", "error": outcome, "id": self.id}


class Reply:
    """The responses to one frame, gathered as its requests end (JSON-RPC allows any
    order in a batch; this one keeps the requests')."""

    __slots__ = ("after", "batch", "entries", "pending", "sealed", "send")

    def __init__(self, send: Callable[[str], None], batch: bool, errors: list[Response]) -> None:
        self.send = send  # writes one frame to the connection, if it is still open
        self.batch = batch
        self.entries: list[Response | None] = list(errors)
        self.pending = 0
        self.sealed = False
        self.after: Callable[[], None] | None = None  # what follows the answer on the wire

    def then(self, after: Callable[[], None]) -> None:
        """Call ``after`` once the answer is written (or, with nothing to answer, once
        every request is done): frames that must follow it (a state channel's current
        value, after the subscribe answer that names the channel)."""
        self.after = after

    def add(self, outcome: Response | Pending | None) -> None:
        if outcome is None:
            return
        if not isinstance(outcome, Pending):
            self.entries.append(outcome)
            return
        index = len(self.entries)
        self.entries.append(None)
        self.pending += 1
        outcome.future.add_done_callback(lambda _: self._filled(index, outcome))

    def _filled(self, index: int, pending: Pending) -> None:
        self.pending -= 1
        if pending.future.cancelled():  # its connection closed while it waited
            return
        self.entries[index] = pending.response()
        self._maybe_send()

    def seal(self) -> None:
        self.sealed = True
        self._maybe_send()

    def _maybe_send(self) -> None:
        if not self.sealed or self.pending:
            return
        responses = [entry for entry in self.entries if entry is not None]
        if responses:
            try:
                text = protocol.encode(responses if self.batch else responses[0])
            except (TypeError, ValueError):  # a merged caller's answer() made one: answer it all the same
                responses = [_encodable(response) for response in responses]
                text = protocol.encode(responses if self.batch else responses[0])
            self.send(text)
        after, self.after = self.after, None
        if after is not None:
            after()


def _encodable(response: Response) -> Response:
    try:
        protocol.encode(response)
    except (TypeError, ValueError):
        return protocol.error_response(
            response.get("id"), protocol.INTERNAL_ERROR, "Internal error", "result_not_serializable"
        )
    return response
