"""The bases of a client's delta subscriptions (docs/protocol.md, "Deltas"): the last
data's exact JSON bytes per channel, and the frames made whole from them. Pure: the
browser module does the same in ``realtime.js``."""

from __future__ import annotations

import json
from typing import Any

from realtime_app.wire.fossil import DeltaError, apply_delta

__all__ = ["DeltaBases", "DeltaError"]


class DeltaBases:
    """Per canonical channel with deltas granted: the last data's JSON bytes (None until a
    full frame came, and again after anything that broke the chain)."""

    def __init__(self) -> None:
        self.bases: dict[str, bytes | None] = {}
        self.resyncing: set[str] = set()  # channels subscribed again for a full frame

    def __contains__(self, channel: object) -> bool:
        return channel in self.bases

    def granted(self, channel: str) -> None:
        """Deltas granted: a full frame comes first (one that came already stays the base)."""
        self.bases.setdefault(channel, None)

    def resync(self, channel: str) -> bool:
        """True the first time after a frame that did not apply: subscribe again once, and
        drop what comes meanwhile quietly until a full frame."""
        if channel in self.resyncing:
            return False
        self.resyncing.add(channel)
        return True

    def reset(self) -> None:
        """A new connection: every channel starts again from a full frame."""
        self.bases = dict.fromkeys(self.bases)
        self.resyncing.clear()

    def forget(self, channel: str) -> None:
        self.bases.pop(channel, None)
        self.resyncing.discard(channel)

    def rebuild(self, channel: str, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` with ``data`` parsed from the full text, or from the delta applied to
        the base; :class:`DeltaError` (the base dropped) when it cannot be: never a guess."""
        data = params.get("data")
        try:
            if not isinstance(data, str):
                raise DeltaError("data is not a string")
            if params.get("delta"):
                base = self.bases.get(channel)
                if base is None:
                    raise DeltaError("a delta without its base")
                text = apply_delta(base, data.encode("latin-1"))
            else:
                text = data.encode("utf-8")
            value = json.loads(text)
        except (UnicodeError, ValueError) as exc:  # DeltaError is a ValueError
            self.bases[channel] = None
            raise exc if isinstance(exc, DeltaError) else DeltaError(str(exc)) from exc
        self.bases[channel] = text
        if not params.get("delta"):
            self.resyncing.discard(channel)
        return {**params, "data": value}
