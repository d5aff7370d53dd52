"""``manage.py realtime_figures [--out DIR] [--json FILE]``: replay and draw the scenarios of
docs/cadence-and-backpressure.md."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from realtime_app.client.scenarios import QueueSeries, cadence_under_degradation, dead_client, passing_spike

__all__ = ["Command"]

MIB = 1024 * 1024


class Command(BaseCommand):
    help = "Replay the cadence and backpressure scenarios on a controlled clock; write CSV, PNG and JSON."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--out", type=Path, default=Path("figures"), help="directory for CSV and PNG files")
        parser.add_argument("--json", type=Path, help="also write all series to this JSON file")

    def handle(self, *args: Any, **options: Any) -> None:
        out: Path = options["out"]
        out.mkdir(parents=True, exist_ok=True)
        self.stdout.write("replaying 1/3: cadence under degradation (126 s)")
        cadence = cadence_under_degradation()
        self.stdout.write("replaying 2/3: dead client (30 s)")
        dead = dead_client()
        self.stdout.write("replaying 3/3: passing spike (30 s)")
        spike = passing_spike()

        self._csv(out / "cadence.csv", ["t_s", "cadence_ms"], zip(cadence.t, cadence.ms, strict=True))
        for name, series in (("dead_client", dead), ("spike", spike)):
            rows = zip(series.t, series.queue_bytes, series.balance, strict=True)
            self._csv(out / f"{name}.csv", ["t_s", "queue_bytes", "drop_balance"], rows)
        self._plot_cadence(cadence.t, cadence.ms, out / "cadence.png")
        self._plot_queue(dead, "Dead client: drains 1 MB/s from 2 s, never recovers", out / "dead_client.png")
        self._plot_queue(spike, "Passing spike: 1 MB/s from 2 s, 8 MB/s again from 9 s", out / "spike.png")

        result = {
            "cadence": {"t": cadence.t, "ms": cadence.ms},
            "dead_client": asdict(dead),
            "spike": asdict(spike),
        }
        if options["json"]:
            options["json"].write_text(json.dumps(result))
            self.stdout.write(f"wrote {options['json']}")
        changes = ", ".join(f"{t:g} s → {ms} ms" for t, _, ms in cadence.changes)
        self.stdout.write(f"cadence changes: {changes}")
        for name, series in (("dead client", dead), ("spike", spike)):
            closed = f"closed with 1013 at {series.closed_at_s:g} s" if series.closed_at_s is not None else "no close"
            self.stdout.write(f"{name}: {closed}; {series.sent} frames sent, {series.dropped} dropped")
        self.stdout.write(self.style.SUCCESS(f"wrote CSV and PNG files to {out}/"))

    def _csv(self, path: Path, header: list[str], rows: Any) -> None:
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            writer.writerows(rows)

    def _plot_cadence(self, t: list[int], ms: list[int], path: Path) -> None:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(8, 3.6))
        ax.step(t, [m / 1000 for m in ms], where="post", color="#417690", label="effective cadence")
        ax.axvspan(20, 70, color="#c0392b", alpha=0.1, label="client needs 4.5 s per frame")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("effective cadence (s)")
        ax.set_title("Adaptive cadence under degradation (desired 1 s)")
        ax.set_yticks([1, 2, 4])
        ax.set_ylim(0, 5.5)  # room above the 4 s plateau for the legend
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def _plot_queue(self, series: QueueSeries, title: str, path: Path) -> None:
        plt = _pyplot()
        fig, ax = plt.subplots(figsize=(8, 3.6))
        ax.plot(series.t, [q / MIB for q in series.queue_bytes], color="#417690", label="queued (MiB)")
        ax.axhline(4, color="#417690", linestyle=":", linewidth=1, label="threshold (4 MiB)")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("queued bytes (MiB)", color="#417690")
        ax2 = ax.twinx()
        ax2.plot(series.t, series.balance, color="#c0392b", label="drop balance")
        ax2.axhline(1000, color="#c0392b", linestyle=":", linewidth=1, label="close after a balance of 1000")
        ax2.set_ylabel("drop balance", color="#c0392b")
        ax2.set_ylim(0, 1100)
        if series.closed_at_s is not None:
            ax.axvline(
                series.closed_at_s, color="black", linewidth=1, label=f"closed with 1013 at {series.closed_at_s:g} s"
            )
        handles = [h for a in (ax, ax2) for h in a.get_legend_handles_labels()[0]]
        labels = [lbl for a in (ax, ax2) for lbl in a.get_legend_handles_labels()[1]]
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False, fontsize=8)
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
