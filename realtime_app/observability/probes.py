"""The cluster view: every live process's probe, read without deciding anything."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from realtime_app.cluster.factory import make_backplane
from realtime_app.exceptions import BackplaneUnavailable
from realtime_app.hub.hubs import get_hub, hub_of_current_loop
from realtime_app.inbound.pools import pools_probe
from realtime_app.observability.schema import BackpressureProbe, ProcessProbe, fields_of
from realtime_app.persistence.write_behind import stores_probe

__all__ = ["PROBE_FIELDS", "cluster_probe", "served_probe", "totals"]

#: Numeric fields of an instance's probe, in the order the table and metrics show them.
PROBE_FIELDS = ("connections", "subscriptions", "published")
#: Summed over the cluster, except the worst-queue fields (``max_``), the maximum.
BACKPRESSURE_FIELDS = tuple(fields_of(BackpressureProbe))


async def cluster_probe() -> dict[str, Any]:
    """``{"generated_at": ms, "clustered": bool, "complete": bool, "instances": [...], "totals": {...}}``.

    From a serving process its own probe is fresh and the others are read from the
    backplane, where each process republishes its probe with a TTL (dead ones drop out).
    From any other process (a command) everything comes from the backplane.
    """
    hub = hub_of_current_loop()
    complete = True
    if hub is not None:
        assert hub.backplane is not None
        clustered = hub.backplane.clustered
        try:
            instances = await hub.cluster_probes()
        except hub.backplane.errors:  # Redis is down: this process still answers for itself
            instances, complete = [hub.probe()], False
    else:
        backplane = make_backplane()
        clustered = backplane.clustered
        down: tuple[type[BaseException], ...] = (BackplaneUnavailable, *backplane.errors)
        try:
            instances = await backplane.cluster_probes()
        except down:  # Redis is down: nothing to list
            instances, complete = [], False
        finally:
            with contextlib.suppress(Exception):
                await backplane.stop()
    instances.sort(key=lambda p: p.get("instance", ""))
    return {
        "generated_at": int(time.time() * 1000),
        "clustered": clustered,
        "complete": complete,  # False: the backplane did not answer, only this process is listed
        "instances": instances,
        "totals": totals(instances),
    }


async def served_probe(*, serving: bool) -> dict[str, Any]:
    """The cluster probe as the HTTP probes show it; with ``serving`` (an ASGI process),
    its own hub started and included. ``"unavailable"`` says why it is incomplete when
    the backplane does not answer (the page answers all the same: no page waits on Redis
    for long)."""
    problem = None
    if serving:
        try:
            await get_hub()
        except BackplaneUnavailable as exc:
            problem = str(exc)
    probe = await cluster_probe()
    if problem is not None or not probe["complete"]:
        probe["unavailable"] = problem or "the backplane did not answer: other processes are not listed"
    # The serving process's HTTP pools, also under a WSGI server (which has no hub to publish them).
    probe["http_pools"] = pools_probe()
    probe["write_behind"] = stores_probe()
    return probe


def totals(instances: list[ProcessProbe]) -> dict[str, Any]:
    """Cluster-wide sums (worst queue: the maximum) and subscribers per channel."""
    probes: list[dict[str, Any]] = [dict(p) for p in instances]  # other processes' may lack a field
    out: dict[str, Any] = {name: sum(p.get(name, 0) for p in probes) for name in PROBE_FIELDS}
    bp = [p.get("backpressure", {}) for p in probes]
    for name in BACKPRESSURE_FIELDS:
        values = [b.get(name, 0) for b in bp]
        out[name] = max(values, default=0) if name.startswith("max_") else sum(values)
    channels: dict[str, int] = {}
    for p in probes:
        for channel, count in p.get("channels", {}).items():
            channels[channel] = channels.get(channel, 0) + count
    out["channels"] = channels
    out["instances"] = len(instances)
    return out
