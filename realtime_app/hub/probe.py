"""This process's probe (:class:`~realtime_app.observability.schema.ProcessProbe`),
read from the hub's rooms without deciding anything. Its size is bounded: the busiest
``PROBE_TOP_CHANNELS`` channels by name, the others counted."""

from __future__ import annotations

import os
import socket
import time
from typing import Protocol

from realtime_app.cluster.base import Backplane
from realtime_app.conf import get_config
from realtime_app.hub.connections import Connection
from realtime_app.hub.fanout import Fanout
from realtime_app.hub.gate import Gate
from realtime_app.hub.ordering import Ordering
from realtime_app.hub.reconciler import Reconciler
from realtime_app.hub.replay import Replays
from realtime_app.hub.tickers import Tickers
from realtime_app.middleware import pools_probe
from realtime_app.observability.schema import HistoryProbe, ProcessProbe
from realtime_app.persistence.write_behind import stores_probe

__all__ = ["process_probe"]


class Probed(Protocol):
    """The hub as its probe reads it: its identity, its channels and its rooms."""

    instance_id: str
    started_at: float
    connections: set[Connection]
    subscribers: dict[str, set[Connection]]
    backplane: Backplane | None
    reconciler: Reconciler
    published: int
    refused: dict[str, int]
    gate: Gate
    fanout: Fanout
    replays: Replays
    ordering: Ordering
    tickers: Tickers


def history_probe(hub: Probed, top: int) -> HistoryProbe:
    """Channels with history as this process last saw them, and its recoveries."""
    seen = hub.backplane.histories if hub.backplane is not None else {}
    busiest = sorted(seen.items(), key=lambda item: (-item[1][1], item[0]))[:top]
    return {
        "channels": {name: {"epoch": epoch, "kept": kept} for name, (epoch, kept) in busiest},
        "recoveries": dict(hub.replays.recoveries),
        "replayed": hub.replays.replayed,
        "gaps": hub.ordering.gaps,
    }


def process_probe(hub: Probed) -> ProcessProbe:
    top = get_config()["PROBE_TOP_CHANNELS"]
    busiest = sorted(hub.subscribers.items(), key=lambda item: (-len(item[1]), item[0]))[:top]
    backplane = hub.backplane
    running = hub.reconciler.running()
    return {
        "instance": hub.instance_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "uptime_s": round(time.time() - hub.started_at, 3),
        "connections": len(hub.connections),
        "subscriptions": sum(len(s) for s in hub.subscribers.values()),
        "channels": {name: len(subs) for name, subs in busiest},
        "channel_count": len(hub.subscribers),
        "tickers": running[:top],
        "ticker_count": len(running),
        "failing_tickers": sorted(hub.tickers.book.failing)[:top],
        "published": hub.published,
        "refused": {**hub.refused, **hub.gate.refused},
        "admission": hub.gate.probe(hub.fanout.unread_refused),
        "history": history_probe(hub, top),
        "send_failures": hub.fanout.send_failures,
        "stale_ticks": hub.tickers.stale_ticks,
        "backplane": {
            "up": not (backplane is not None and backplane.outage.down),
            "outages": backplane.outage.outages if backplane is not None else 0,
        },
        "backpressure": hub.fanout.probe(),
        "http_pools": pools_probe(),  # type: ignore[typeddict-item]
        "write_behind": stores_probe(),
    }
