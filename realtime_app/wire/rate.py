"""Cadence in the channel name: build and read ``base`` / ``base:<ms>`` names.

One pure module used by the hub, the Python client and the tests (the browser module
mirrors it in ``rateChannel``). A client chooses a cadence by naming it; the server keeps
control by clamping the asked cadence into the family's bounds, and refuses anything that
is not exactly ``base`` or ``base:<ASCII digits>``.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["MAX_RATE_DIGITS", "RateBounds", "is_rate_channel", "nearest_cadence", "parse_rate", "rate_channel"]

#: A suffix longer than this is not a cadence (60000 ms has 5 digits; 9 leaves room and
#: keeps ``int()`` of hostile input cheap).
MAX_RATE_DIGITS = 9


class RateBounds(NamedTuple):
    """The cadences a family accepts, in milliseconds."""

    default: int
    min: int
    max: int


def rate_channel(base: str, ms: int, default: int) -> str:
    """Name the channel of ``base`` at cadence ``ms``: ``base`` for the default, else ``base:ms``."""
    if isinstance(ms, bool) or not isinstance(ms, int) or ms <= 0:
        raise ValueError(f"cadence must be a positive int of milliseconds, got {ms!r}")
    return base if ms == default else f"{base}:{ms}"


def _suffix(name: str, base: str) -> str | None:
    """The cadence suffix of ``name`` (``""`` for the bare base), or None if not of ``base``."""
    if name == base:
        return ""
    if not name.startswith(base) or name[len(base) : len(base) + 1] != ":":
        return None
    digits = name[len(base) + 1 :]
    # isascii() first: str.isdigit() also accepts "١٢٣" and "²".
    if not digits or len(digits) > MAX_RATE_DIGITS or not (digits.isascii() and digits.isdigit()):
        return None
    return digits


def is_rate_channel(name: str, base: str) -> bool:
    """True only for ``base`` and ``base:<ASCII digits>`` (at most ``MAX_RATE_DIGITS``)."""
    return _suffix(name, base) is not None


def parse_rate(name: str, base: str, bounds: RateBounds | tuple[int, int, int]) -> int | None:
    """The cadence in ms that ``name`` asks of family ``base``, clamped into ``bounds``.

    ``bounds`` is ``(default, min, max)``. Returns None when ``name`` is not a channel of
    this family (garbage suffix, other base): callers refuse it.
    """
    default, low, high = bounds
    digits = _suffix(name, base)
    if digits is None:
        return None
    if digits == "":
        return default
    return max(low, min(high, int(digits)))


def nearest_cadence(ms: int, running: list[int]) -> int:
    """The cadence of ``running`` closest to ``ms`` (the faster one on a tie).

    A family that already runs its most cadences answers a new one with this, so that a
    client naming many cadences cannot start as many tickers; the channel name in the
    answer tells the client what it got.
    """
    if not running:
        raise ValueError("no running cadence to choose from")
    return min(running, key=lambda candidate: (abs(candidate - ms), candidate))
