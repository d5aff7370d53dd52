"""The scenarios of docs/cadence-and-backpressure.md, replayed with the real AdaptiveRate and
decide_send: the results are pinned."""

import json

from django.core.management import call_command

from realtime_app.client.scenarios import cadence_under_degradation, dead_client, passing_spike


def test_cadence_under_degradation_has_the_expected_shape():
    series = cadence_under_degradation()
    assert len(series.t) == 127 and series.t[0] == 0 and series.t[-1] == 126
    steps = [(round(t, 1), ms) for t, _, ms in series.changes]
    # 1 s → 2 s → 4 s, one failed probe back to 2 s and down to 4 s again, then 2 s and 1 s
    assert steps == [(24.5, 2000), (33.5, 4000), (56.0, 2000), (65.0, 4000), (85.0, 2000), (93.0, 1000)]
    by_second = dict(zip(series.t, series.ms, strict=True))
    assert by_second[10] == 1000 and by_second[30] == 2000 and by_second[45] == 4000
    assert by_second[60] == 2000 and by_second[75] == 4000 and by_second[90] == 2000 and by_second[120] == 1000


def test_dead_client_is_closed_after_a_balance_of_1000():
    series = dead_client()
    assert (series.closed_at_s, series.sent, series.dropped) == (29.48, 1167, 1781)
    assert max(series.queue_bytes) <= 4 * 1024 * 1024 + 32 * 1024  # the plateau
    assert series.balance[3] == 0 < series.balance[10] < series.balance[20] < series.balance[29]
    assert series.balance[-1] == 1000


def test_passing_spike_decays_without_close():
    series = passing_spike()
    assert series.closed_at_s is None
    peak = max(series.balance)
    assert 150 < peak < 1000 and series.balance.index(peak) == 9
    assert series.balance[12:] == [0] * (len(series.balance) - 12)
    assert (series.sent, series.dropped) == (2642, 359)


def test_realtime_figures_writes_csv_png_and_json(tmp_path):
    out = tmp_path / "figures"
    call_command("realtime_figures", "--out", str(out), "--json", str(tmp_path / "all.json"))
    for name in ("cadence", "dead_client", "spike"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / f"{name}.csv").read_text().count("\n") >= 31
    data = json.loads((tmp_path / "all.json").read_text())
    assert set(data) == {"cadence", "dead_client", "spike"}
    assert set(data["dead_client"]) == {"t", "queue_bytes", "balance", "closed_at_s", "sent", "dropped"}
    assert data["dead_client"]["closed_at_s"] == 29.48 and data["spike"]["closed_at_s"] is None
    assert len(data["cadence"]["t"]) == len(data["cadence"]["ms"]) == 127
