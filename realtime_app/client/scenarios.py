"""The scenarios of docs/cadence-and-backpressure.md, replayed on a controlled clock (no sleeping, no I/O).

They drive the real :class:`~realtime_app.client.adaptive.AdaptiveRate` and the real
:func:`~realtime_app.outbound.backpressure.decide_send` — no copy of their logic — with a simple
model of a client, one millisecond at a time, and return one sample per second.
``manage.py realtime_figures`` writes them as CSV/JSON and draws them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from realtime_app.client.adaptive import AdaptiveRate
from realtime_app.outbound.backpressure import CLOSE, SEND, BackpressureConfig, DropState, decide_send

__all__ = ["CadenceSeries", "QueueSeries", "cadence_under_degradation", "dead_client", "passing_spike", "replay_all"]


@dataclass
class CadenceSeries:
    t: list[int] = field(default_factory=list)  # seconds
    ms: list[int] = field(default_factory=list)  # effective cadence
    changes: list[tuple[float, str, int]] = field(default_factory=list)  # (s, decision, new cadence)


def cadence_under_degradation(
    *,
    desired_ms: int = 1000,
    slow_from_s: float = 20,
    slow_until_s: float = 70,
    absorb_ms: int = 4500,
    duration_s: int = 126,
) -> CadenceSeries:
    """Scenario 1: a client that needs ``absorb_ms`` per frame between two times.

    The model: the server's ticker of the subscribed cadence publishes at once when it
    starts and then every cadence; a busy client keeps only the latest frame of its
    channel (a state channel) and handles it when it is free; ``note_frame`` runs when the
    handler runs; the watchdog runs every cadence while the client is idle; a decision
    switches the subscription at once (make-before-break: the new ticker starts).
    """
    rate = AdaptiveRate(desired_ms)
    series = CadenceSeries()
    next_tick, pending, busy_until, watch_at = 0, None, 0, desired_ms
    for now in range(duration_s * 1000 + 1):
        if now == next_tick:
            pending = now
            next_tick += rate.interval_ms
        decision = None
        if now >= busy_until and pending is not None:
            pending = None
            decision = rate.note_frame(now)
            slow = slow_from_s * 1000 <= now < slow_until_s * 1000
            busy_until = now + (absorb_ms if slow else 0)
            watch_at = now + rate.interval_ms
        elif now >= busy_until and now >= watch_at:
            decision = rate.check_starvation(now)
            watch_at = now + rate.interval_ms
        if decision is not None:
            series.changes.append((now / 1000, decision, rate.interval_ms))
            next_tick, pending = now + 1, None  # the new channel's ticker starts (next millisecond)
            watch_at = now + rate.interval_ms
        if now % 1000 == 0:
            series.t.append(now // 1000)
            series.ms.append(rate.interval_ms)
    return series


@dataclass
class QueueSeries:
    t: list[int] = field(default_factory=list)  # seconds
    queue_bytes: list[int] = field(default_factory=list)
    balance: list[int] = field(default_factory=list)
    closed_at_s: float | None = None
    sent: int = 0
    dropped: int = 0


def _queue(
    drain_bytes_per_s: list[tuple[float, float]],
    *,
    frame_bytes: int,
    frames_per_s: int,
    duration_s: int,
    config: BackpressureConfig,
) -> QueueSeries:
    """A server pushing frames to a client that drains at a rate changing over time."""
    state = DropState()
    series = QueueSeries()
    queued = 0.0
    every_ms = 1000 // frames_per_s
    for now in range(duration_s * 1000 + 1):
        rate = next(r for start, r in reversed(drain_bytes_per_s) if now >= start * 1000)
        queued = max(0.0, queued - rate / 1000)
        if series.closed_at_s is None and now % every_ms == 0:
            decision = decide_send(int(queued), config, state)
            if decision is SEND:
                queued += frame_bytes
                series.sent += 1
            elif decision is CLOSE:
                series.closed_at_s = now / 1000
            else:
                series.dropped += 1
        if now % 1000 == 0:
            series.t.append(now // 1000)
            series.queue_bytes.append(int(queued))
            series.balance.append(state.balance)
    return series


def dead_client(config: BackpressureConfig | None = None, duration_s: int = 30) -> QueueSeries:
    """Scenario 2: 100 frames/s of 32 KiB; the client drains 8 MB/s, then 1 MB/s from 2 s on."""
    return _queue(
        [(0, 8e6), (2, 1e6)],
        frame_bytes=32 * 1024,
        frames_per_s=100,
        duration_s=duration_s,
        config=config or BackpressureConfig(),
    )


def passing_spike(config: BackpressureConfig | None = None, duration_s: int = 30) -> QueueSeries:
    """Scenario 3: as scenario 2, but the client recovers to 8 MB/s at 9 s."""
    return _queue(
        [(0, 8e6), (2, 1e6), (9, 8e6)],
        frame_bytes=32 * 1024,
        frames_per_s=100,
        duration_s=duration_s,
        config=config or BackpressureConfig(),
    )


def replay_all() -> dict[str, Any]:
    """The three scenarios in the JSON shape of ``realtime_figures --json``."""
    cadence = cadence_under_degradation()
    return {
        "cadence": {"t": cadence.t, "ms": cadence.ms},
        "dead_client": asdict(dead_client()),
        "spike": asdict(passing_spike()),
    }
