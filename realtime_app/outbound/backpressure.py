"""The one rule that decides, frame by frame, whether a slow connection gets a frame.

Pure and allocation-free on the nominal path: the transport adapters read the bytes the
server has accepted and not yet put on the network, and ask :func:`decide_send`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["POLICIES", "BackpressureConfig", "Decision", "DropState", "decide_send"]

#: What a channel's frames do over the threshold (``POLICIES`` rule key ``"backpressure"``);
#: the global ``BACKPRESSURE_POLICY`` is one of the first two.
POLICIES = ("drop", "close", "conflate")


class Decision(enum.Enum):
    """What to do with the next frame."""

    SEND = "send"
    DROP = "drop"
    CLOSE = "close"
    HOLD = "hold"  # conflated: kept as its channel's newest frame, written once the queue drains


SEND = Decision.SEND
DROP = Decision.DROP
CLOSE = Decision.CLOSE
HOLD = Decision.HOLD


@dataclass(frozen=True, slots=True)
class BackpressureConfig:
    """Settings of the guard.

    Attributes:
        max_backpressure: bytes queued for a connection above which frames are refused;
            0 disables the guard.
        policy: ``"drop"`` discards the frame, ``"close"`` closes with 1013 at once.
        close_after_drops: drop balance at which a ``drop`` connection is closed with
            1013; 0 never closes.
    """

    # The settings' defaults (conf.DEFAULTS, held equal by tests/test_backpressure_rule.py):
    # not imported, so that the clients' twin of this rule imports nothing of settings.
    max_backpressure: int = 4 * 1024 * 1024
    policy: str = "drop"
    close_after_drops: int = 1000

    def __post_init__(self) -> None:
        if self.max_backpressure < 0:
            raise ValueError(f"max_backpressure must be >= 0, got {self.max_backpressure}")
        if self.policy not in ("drop", "close"):
            raise ValueError(f"policy must be 'drop' or 'close', got {self.policy!r}")
        if self.close_after_drops < 0:
            raise ValueError(f"close_after_drops must be >= 0, got {self.close_after_drops}")


@dataclass(slots=True)
class DropState:
    """Per-connection memory of the guard: the drop balance and the frames refused.

    Nothing is counted on the nominal path (a counter past 256 allocates a new int).
    """

    balance: int = 0
    drops: int = 0


def decide_send(buffered: int, config: BackpressureConfig, state: DropState) -> Decision:
    """Decide the fate of one frame given ``buffered`` bytes not yet on the network.

    Under the threshold the frame is sent and the drop balance decays by one (never below
    zero). Above it, ``close`` closes at once; ``drop`` discards the frame and adds one to
    the balance, closing once the balance reaches ``close_after_drops``. A balance rather
    than a streak: a queue that oscillates around the threshold never makes a streak, and
    a second byte threshold is unreachable once frames are dropped.
    """
    limit = config.max_backpressure
    if limit == 0 or buffered <= limit:
        if state.balance:
            state.balance -= 1
        return SEND
    if config.policy == "close":
        return CLOSE
    state.drops += 1
    state.balance += 1
    if config.close_after_drops and state.balance >= config.close_after_drops:
        return CLOSE
    return DROP
