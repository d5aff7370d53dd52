"""Delta subscriptions (``"delta": "fossil"`` in ``subscribe``): the frames, built once per
publication whoever receives them.

On such a subscription every ``message`` notification carries ``"delta"``: ``false`` with
``data`` the publication's JSON **text** (a string: the client keeps the exact bytes as
its base), or ``true`` with ``data`` the Fossil delta (:mod:`realtime_app.wire.fossil`)
from the previous publication's JSON text to this one's, one character per byte
(U+0000-U+00FF), since a delta may cut a UTF-8 sequence in two. A connection gets a delta
only when it received the previous publication of the channel; after a drop, a
conflated frame, a reconnect or a new subscribe it gets a full frame, and every
``FULL_EVERY``-th publication is full for everyone. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from realtime_app.wire.fossil import TooCostly, create_delta
from realtime_app.wire.protocol import encode, notification_head

__all__ = ["FOSSIL", "FULL_EVERY", "ChannelDeltas", "DeltaFrames", "split_notification"]

FOSSIL = "fossil"
#: A full frame for every subscriber this often (a client that lost its base by a bug of
#: its own comes back without asking).
FULL_EVERY = 100
#: Publications larger than this are sent whole: the delta search is a cost per byte.
MAX_DELTA_BYTES = 64 * 1024
#: The longest a delta search may hold the event loop, seconds: past it the publication
#: goes whole (bench/bandwidth.py measures the worst case).
MAX_DELTA_SECONDS = 0.004


def split_notification(channel: str, text: str) -> tuple[str, str]:
    """A ``message`` notification's ``data`` JSON and its tail (``seq``, ``epoch``, ``ts``)."""
    head = notification_head(channel, "")
    cut = text.rfind(',"seq":')
    if not text.startswith(head) or cut < len(head):
        raise ValueError(f"not a notification of {channel!r}")
    return text[len(head) : cut], text[cut:]


@dataclass(frozen=True, slots=True)
class DeltaFrames:
    """The two frames of one publication for delta subscribers; ``delta`` (None on the
    first publication, or every ``FULL_EVERY``) goes to whoever received ``base_seq``."""

    full: str
    delta: str | None
    base_seq: int


class ChannelDeltas:
    """The last publication of each channel with delta subscribers (its data's UTF-8
    bytes), and the frames of the next one."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, bytes]] = {}

    def frames(self, channel: str, text: str, seq: int) -> DeltaFrames:
        """The full text and, when worth it, the delta from the last publication: never for
        the first, every ``FULL_EVERY``-th, a publication over ``MAX_DELTA_BYTES``, a
        search past its budget (in work or in time), or a delta not under half the data."""
        data_json, tail = split_notification(channel, text)
        data = data_json.encode("utf-8")
        head = notification_head(channel, "")
        full = f'{head}{encode(data_json)},"delta":false{tail}'
        previous = self.last.get(channel)
        self.last[channel] = (seq, data)
        if previous is None or seq % FULL_EVERY == 0 or previous[0] >= seq or len(data) > MAX_DELTA_BYTES:
            return DeltaFrames(full, None, -1)
        try:
            delta = create_delta(previous[1], data, max_seconds=MAX_DELTA_SECONDS)
        except TooCostly:
            return DeltaFrames(full, None, -1)
        if len(delta) * 2 > len(data):  # random content: no gain
            return DeltaFrames(full, None, -1)
        return DeltaFrames(full, f'{head}{encode(delta.decode("latin-1"))},"delta":true{tail}', previous[0])

    def prime(self, channel: str, text: str, seq: int) -> bool:
        """Take ``text`` (publication ``seq``) as the base of the next delta when there is
        none yet (its first delta subscriber just got it whole); True when it is the base."""
        if channel not in self.last:
            data_json, _ = split_notification(channel, text)
            self.last[channel] = (seq, data_json.encode("utf-8"))
        return self.last[channel][0] == seq

    @staticmethod
    def full_only(channel: str, text: str) -> str:
        """The full text frame alone (a conflated channel: no delta is built)."""
        data_json, tail = split_notification(channel, text)
        return f'{notification_head(channel, "")}{encode(data_json)},"delta":false{tail}'

    def forget(self, channel: str) -> None:
        self.last.pop(channel, None)
