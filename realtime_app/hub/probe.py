"""This process's probe (:class:`~realtime_app.observability.schema.ProcessProbe`),
read from the hub's rooms without deciding anything. Its size is bounded whatever the
number of connections: the busiest ``PROBE_TOP_CHANNELS`` channels by name, the others
counted; the ``PROBE_TOP_CONNECTIONS`` connections with the most bytes queued and the most
drops, the others counted.

Its walks over every channel (the busiest lists, the per-template and presence counts)
are what grows with the rooms a process holds: published every other beat, they kept a
process holding 20,000 idle rooms busy. A process with more than :data:`FRESH_UP_TO`
channels reuses them until they have paid for themselves — at most
:data:`PROBE_CPU_SHARE` of a core: its busiest lists, and the subscriptions, tickers and
per-room counts found by a walk, may be that old; the counters kept as things happen
(connections, channels, frames, publications, presence writes, recoveries) are read
fresh at every probe."""

from __future__ import annotations

import heapq
import itertools
import os
import resource
import socket
import time
import weakref
from typing import Any, Protocol

from realtime_app.cluster.roles import HistoryStore
from realtime_app.conf.runtime import runtime, settings
from realtime_app.declarations.instances import InstanceBook
from realtime_app.hub.connections import Connection
from realtime_app.hub.fanout import Fanout
from realtime_app.hub.gate import Gate
from realtime_app.hub.ordering import Ordering
from realtime_app.hub.outbox import outbox_probe
from realtime_app.hub.outcomes import Outcomes
from realtime_app.hub.presence import Presence
from realtime_app.hub.reconciler import Reconciler
from realtime_app.hub.replay import Replays
from realtime_app.hub.replies import Replies
from realtime_app.hub.shares import ShareBook
from realtime_app.hub.tickers import Tickers
from realtime_app.inbound.pools import pools_probe
from realtime_app.observability.schema import (
    BackplaneProbe,
    ConnectionProbe,
    HistoryProbe,
    ProcessProbe,
    TemplateProbe,
)
from realtime_app.persistence.write_behind import stores_probe

__all__ = ["FRESH_UP_TO", "PROBE_CPU_SHARE", "process_probe"]

#: Channels with history and no subscriber here the probe remembers, at most.
HISTORIES_UNSUBSCRIBED = 1000
#: A process with at most this many channels walks them at every probe.
FRESH_UP_TO = 1000
#: Past it, the walks take at most this share of a core: reused for (their cost / share) s.
PROBE_CPU_SHARE = 0.0002


class Probed(Protocol):
    """The hub as its probe reads it: its identity, its channels and its rooms."""

    instance_id: str
    started_at: float
    connections: set[Connection]
    subscribers: dict[str, set[Connection]]

    @property
    def backplane(self) -> HistoryStore | None: ...

    reconciler: Reconciler
    published: int
    refused: dict[str, int]
    gate: Gate
    fanout: Fanout
    outcomes: Outcomes
    replies: Replies
    replays: Replays
    ordering: Ordering
    tickers: Tickers
    instances: InstanceBook
    shares: ShareBook
    template_published: dict[str, int]
    presence: Presence


def history_probe(hub: Probed, top: int) -> HistoryProbe:
    """Channels with history as this process last saw them, and its recoveries. Past
    :data:`HISTORIES_UNSUBSCRIBED` channels without subscribers here, those are forgotten:
    what churned through the process is not kept for ever."""
    seen = hub.backplane.histories if hub.backplane is not None else {}
    if len(seen) > len(hub.subscribers) + HISTORIES_UNSUBSCRIBED:
        for gone in [name for name in seen if name not in hub.subscribers]:
            del seen[gone]
    busiest = heapq.nsmallest(top, seen.items(), key=lambda item: (-item[1][1], item[0]))
    return {
        "channels": {name: {"epoch": epoch, "kept": kept} for name, (epoch, kept) in busiest},
        "recoveries": dict(hub.replays.recoveries),
        "replayed": hub.replays.replayed,
        "gaps": hub.ordering.gaps,
    }


def rss_bytes() -> int:
    """Resident memory now (Linux ``/proc``; elsewhere the peak, which is what there is)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def connection_probe(hub: Probed, conn: Connection, now: float, queued: int) -> ConnectionProbe:
    user = conn.scope.get("user")
    name = user.get_username() if user is not None and getattr(user, "is_authenticated", False) else None
    identity = conn.identity
    return {
        "id": conn.id,
        "user": name,
        "address": conn.address,
        "channels": sorted(conn.subscriptions)[:20],
        "channel_count": len(conn.subscriptions),
        "queued_bytes": queued,
        "drops": conn.guard.state.drops,
        "conflated": conn.guard.conflated,
        "in_flight": hub.gate.admission.in_flight(identity) if identity is not None else 0,
        "age_s": round(now - conn.opened_at, 1),
    }


def top_connections(hub: Probed, top: int, queued: dict[Connection, int]) -> list[ConnectionProbe]:
    """The ``top`` connections with the most bytes queued (the lagging ones, as read for
    this probe), then those with the most drops (each once); while fewer lag, others fill
    the list (read now: ``top`` reads at most, never every connection)."""
    if not top:
        return []
    most = heapq.nlargest(top, queued, key=lambda c: (queued[c], -c.id))
    listed = dict.fromkeys([*most, *hub.fanout.top_droppers[:top]])
    for conn in itertools.islice(hub.connections, top):
        if len(listed) >= top:
            break
        listed.setdefault(conn)
    now = time.monotonic()
    return [
        connection_probe(hub, conn, now, queued[conn] if conn in queued else conn.guard.buffered()) for conn in listed
    ]


def _cadence(name: str) -> int | None:
    """A channel's cadence as the registry resolves it (a family's base at its default):
    never guessed from a trailing number, which may be an instance's id (``order:1``)."""
    from realtime_app.declarations.registry import registry

    spec = registry.find(name)
    return spec.interval_ms if spec is not None else None


class Walks(weakref.WeakKeyDictionary[Any, tuple[float, float, dict[str, Any]]]):
    """Per hub, its walks as last made: (when, what they cost, what they found); a part of
    the process's runtime."""


def _walks(hub: Probed, top: int) -> dict[str, Any]:
    """The parts of the probe that walk every channel: fresh in a small process, else
    reused until their last cost is paid at :data:`PROBE_CPU_SHARE` of a core."""
    now = time.monotonic()
    walked = runtime().part(Walks)
    kept = walked.get(hub)
    if kept is not None and len(hub.subscribers) > FRESH_UP_TO and now - kept[0] < kept[1] / PROBE_CPU_SHARE:
        return kept[2]
    began = time.thread_time()
    busiest = heapq.nsmallest(top, hub.subscribers.items(), key=lambda item: (-len(item[1]), item[0]))
    running = hub.reconciler.running()
    frames = hub.fanout.channel_frames
    for gone in [name for name in frames if name not in hub.subscribers]:
        del frames[gone]  # counted while the channel has subscribers here
    found: dict[str, Any] = {
        "subscriptions": sum(len(s) for s in hub.subscribers.values()),
        "channels": {name: len(subs) for name, subs in busiest},
        "tickers": running[:top],
        "ticker_count": len(running),
        "channel_frames": {name: frames.get(name, 0) for name, _ in busiest},
        "channel_cadences": {name: _cadence(name) for name, _ in busiest},
        "history": history_probe(hub, top),
        "templates": templates_probe(hub),
        "presence": hub.presence.probe(top),
    }
    walked[hub] = (now, time.thread_time() - began, found)
    return found


def _published(templates: dict[str, TemplateProbe], published: dict[str, int]) -> dict[str, TemplateProbe]:
    """A walk's per-template counts with the publications counted since."""
    out = {pattern: {**probe, "published": published.get(pattern, 0)} for pattern, probe in templates.items()}
    for pattern, count in published.items():
        out.setdefault(pattern, {"instances": 0, "subscribers": 0, "published": count, "busiest": {}})
    return out  # type: ignore[return-value]


def process_probe(hub: Probed) -> ProcessProbe:
    config = settings()
    top = config.probe_top_channels
    backplane = hub.backplane
    walked = _walks(hub, top)
    times = os.times()
    queued = hub.fanout.lagging(config.probe_top_connections)  # never a read of every connection
    return {
        "instance": hub.instance_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "uptime_s": round(time.time() - hub.started_at, 3),
        "rss_bytes": rss_bytes(),
        "cpu_seconds": round(times.user + times.system, 3),
        "connections": len(hub.connections),
        "subscriptions": walked["subscriptions"],
        "channels": walked["channels"],
        "channel_count": len(hub.subscribers),
        "tickers": walked["tickers"],
        "ticker_count": walked["ticker_count"],
        "failing_tickers": sorted(hub.tickers.book.failing)[:top],
        "published": hub.published,
        "frames_out": hub.fanout.frames_out,
        "channel_frames": walked["channel_frames"],
        "channel_cadences": walked["channel_cadences"],
        "top_connections": top_connections(hub, config.probe_top_connections, queued),
        "refused": {**hub.refused, **hub.gate.refused},
        "backplane_bytes": hub.shares.total_bytes(),
        "admission": hub.gate.probe(hub.replies.unread_refused),
        "history": {
            "channels": walked["history"]["channels"],
            "recoveries": dict(hub.replays.recoveries),
            "replayed": hub.replays.replayed,
            "gaps": hub.ordering.gaps,
        },
        "send_failures": hub.outcomes.send_failures,
        "stale_ticks": hub.tickers.stale_ticks,
        "backplane": backplane_probe(backplane),
        "backpressure": hub.fanout.probe(queued),
        "http_pools": pools_probe(),  # type: ignore[typeddict-item]
        "write_behind": stores_probe(),
        "templates": _published(walked["templates"], hub.template_published),
        "outbox": outbox_probe(hub),
        "presence": {**walked["presence"], **hub.presence.counters()},  # type: ignore[typeddict-item]
        "draining": hub.gate.draining,
    }


#: Instances named per template in the probe (the busiest by subscribers).
TOP_INSTANCES = 5


def templates_probe(hub: Probed) -> dict[str, TemplateProbe]:
    """Per template: live instances, subscriptions, publications, the busiest instances."""
    out: dict[str, TemplateProbe] = {}
    for pattern, bases in hub.instances.live.items():
        sizes = {base: sum(len(hub.subscribers.get(c, ())) for c in channels) for base, channels in bases.items()}
        out[pattern] = {
            "instances": len(bases),
            "subscribers": sum(sizes.values()),
            "published": hub.template_published.get(pattern, 0),
            "busiest": dict(heapq.nlargest(TOP_INSTANCES, sizes.items(), key=lambda item: (item[1], item[0]))),
        }
    for pattern, count in hub.template_published.items():
        out.setdefault(pattern, {"instances": 0, "subscribers": 0, "published": count, "busiest": {}})
    return out


def backplane_probe(backplane: HistoryStore | None) -> BackplaneProbe:
    """Up (every Redis server answers), outages, and each server's own (none in memory)."""
    if backplane is None:
        return {"up": True, "outages": 0, "shards": []}
    return {"up": not backplane.outage.down, "outages": backplane.outage.outages, "shards": backplane.shards_probe()}


def process_start() -> float:
    """When this process started (uptime is the process's, not the hub's)."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return time.time()
