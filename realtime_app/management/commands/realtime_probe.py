"""``manage.py realtime_probe [--json] [--watch SECONDS]``: the cluster probe, from outside."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from asgiref.sync import async_to_sync
from django.core.management.base import BaseCommand, CommandError, CommandParser

from realtime_app.observability.probes import cluster_probe

__all__ = ["Command"]

COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("instance", lambda p: p.get("instance", "")),
    ("pid", lambda p: p.get("pid", "")),
    ("uptime", lambda p: f"{p.get('uptime_s', 0):.0f}s"),
    ("conns", lambda p: p.get("connections", 0)),
    ("subs", lambda p: p.get("subscriptions", 0)),
    ("tickers", lambda p: p.get("ticker_count", len(p.get("tickers", [])))),
    ("failing", lambda p: len(p.get("failing_tickers", []))),
    ("backplane", lambda p: _backplane(p.get("backplane", {}))),
    ("worst queue", lambda p: _bytes(p.get("backpressure", {}).get("max_buffered_amount", 0))),
    ("total queued", lambda p: _bytes(p.get("backpressure", {}).get("total_buffered_amount", 0))),
    ("slow", lambda p: p.get("backpressure", {}).get("slow_consumers", 0)),
    ("drops", lambda p: p.get("backpressure", {}).get("drops", 0)),
    ("1013", lambda p: p.get("backpressure", {}).get("closes", 0)),
    ("rpc run/wait", lambda p: f"{p.get('admission', {}).get('running', 0)}/{p.get('admission', {}).get('queued', 0)}"),
    ("admitted", lambda p: p.get("admission", {}).get("admitted", 0)),
    ("merged", lambda p: p.get("admission", {}).get("coalesced", 0)),
    ("refused", lambda p: _refused(p.get("admission", {}).get("refused", {}))),
    ("http pools run/wait (503)", lambda p: _pools(p.get("http_pools", {}))),
    ("unsaved (oldest)", lambda p: _unsaved(p.get("write_behind", {}))),
    ("instances (subs)", lambda p: _templates(p.get("templates", {}))),
    ("resumes ok/lost (replayed)", lambda p: _resumes(p.get("history", {}))),
]


def _backplane(backplane: dict[str, Any]) -> str:
    """``up``, or ``down`` with the shards that do not answer (``down: shard 1``)."""
    if backplane.get("up", True):
        return "up"
    down = [str(shard["index"]) for shard in backplane.get("shards", []) if not shard.get("up", True)]
    return f"down: shard {', '.join(down)}" if len(backplane.get("shards", [])) > 1 and down else "down"


def _resumes(history: dict[str, Any]) -> str:
    """``12/1 (340)``: resumes recovered / not recovered, and the messages replayed."""
    recoveries = history.get("recoveries", {})
    return f"{recoveries.get('served', 0)}/{recoveries.get('failed', 0)} ({history.get('replayed', 0)})"


def _unsaved(stores: dict[str, dict[str, Any]]) -> str:
    """``demo.inventory 12 (4.1s, 2 failing)``: dirty objects and the oldest unsaved change."""
    parts = []
    for name, store in stores.items():
        text = f"{name} {store['dirty']} ({store['oldest_unsaved_s']:.1f}s"
        if store["consecutive_failures"]:
            text += f", {store['consecutive_failures']} failed flushes"
        parts.append(text + ")")
    return ", ".join(parts) or "–"


def _templates(templates: dict[str, dict[str, Any]]) -> str:
    """``lot:<int:id> 812 (2403)``: live instances (their subscribers) per template."""
    return ", ".join(f"{name} {t['instances']} ({t['subscribers']})" for name, t in templates.items()) or "–"


def _pools(pools: dict[str, dict[str, Any]]) -> str:
    """``heavy 2/5 (3)``: running/waiting and refusals per pool."""
    return (
        ", ".join(
            f"{name} {pool['running']}/{pool['waiting']} ({sum(pool['refused'].values())})"
            for name, pool in pools.items()
        )
        or "–"
    )


def _refused(refused: dict[str, int]) -> str:
    """``12 (rate_limited 10, too_many_in_flight 2)``: the total, then the reasons seen."""
    seen = {reason: n for reason, n in refused.items() if n}
    if not seen:
        return "0"
    return f"{sum(seen.values())} ({', '.join(f'{r} {n}' for r, n in sorted(seen.items()))})"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def table(probe: dict[str, Any]) -> str:
    """The probe as a fixed-width table, one row per live process."""
    rows = [[str(get(p)) for _, get in COLUMNS] for p in probe["instances"]]
    heads = [name for name, _ in COLUMNS]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    if not rows:
        lines.append("(no live process)")
    return "\n".join(lines)


class Command(BaseCommand):
    help = "Show the realtime cluster's probe: one row per live server process."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="print the probe as JSON")
        parser.add_argument("--watch", type=float, metavar="SECONDS", help="repeat every SECONDS until interrupted")

    def handle(self, *args: Any, **options: Any) -> None:
        watch = options["watch"]
        if watch is not None and watch <= 0:
            raise CommandError("--watch takes a positive number of seconds")
        while True:
            probe = async_to_sync(cluster_probe)()
            if not probe["clustered"]:
                raise CommandError(
                    "the channel layer is in-memory: each server process is alone and this command cannot see it; "
                    "use GET /realtime/api/health on the server, or run the servers on the Redis channel layer"
                )
            if options["json"]:
                self.stdout.write(json.dumps(probe, indent=None if watch else 2))
            else:
                stamp = time.strftime("%H:%M:%S")
                self.stdout.write(f"{stamp}  {probe['totals']['instances']} live process(es)\n{table(probe)}\n")
            if watch is None:
                return
            try:
                time.sleep(watch)
            except KeyboardInterrupt:
                return
