"""Event history and resume, in-process (the embedded backplane): the rule, the wire, the
race between a replay and live publications, and bad ``since`` values."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from django.test import override_settings

from realtime_app import ConfigurationError
from realtime_app.conf import get_config
from realtime_app.declarations.declare import event_channel
from realtime_app.declarations.registry import Registry, registry
from realtime_app.wire.history import HistoryEntry, HistoryPolicy, HistoryRead, Since, plan_resume
from realtime_app.wire.protocol import encode, notification_text
from tests.support.asgi_client import Client
from tests.testapp.backplanes import GatedHistory

POLICY = HistoryPolicy(size=5, ttl_s=60)


@contextlib.asynccontextmanager
async def gated_hub(**overrides: object) -> AsyncIterator[Any]:
    """A hub on ``GatedHistory`` (its history reads wait while the gate is shut), the gate
    open; ``overrides``: more of ``REALTIME_APP``."""
    from realtime_app.hub import get_hub

    GatedHistory.gate, GatedHistory.reading = asyncio.Event(), asyncio.Event()
    config = {**get_config(), "BACKPLANE": "tests.testapp.backplanes.GatedHistory", **overrides}
    with override_settings(REALTIME_APP=config):
        hub = await get_hub()
        try:
            GatedHistory.gate.set()
            yield hub
        finally:
            await hub.aclose()


def shut_gate() -> None:
    """History reads wait from now on, and ``GatedHistory.reading`` says when one does."""
    GatedHistory.gate.clear()
    GatedHistory.reading.clear()


def read(epoch: str, top: int, seqs: list[int], ts: int = 1_000_000) -> HistoryRead:
    return HistoryRead(epoch, top, len(seqs), [HistoryEntry(s, ts, f"t{s}") for s in seqs])


@pytest.mark.parametrize(
    ("since", "history", "recovered", "sent", "reason"),
    [
        (Since(3, "e"), read("e", 5, [4, 5]), True, [4, 5], ""),
        (Since(5, "e"), read("e", 5, []), True, [], ""),  # nothing missed
        (Since(3, "e"), read("f", 5, [4, 5]), False, [], "epoch_changed"),
        (Since(1, "e"), read("e", 5, [3, 4, 5]), False, [], "too_old"),  # 2 is gone
        (Since(3, "e"), read("e", 6, [4, 5]), True, [4, 5], ""),  # the first page: the replay reads on
        (Since(0, "e"), read("e", 6, [1, 2, 3, 4, 5, 6]), False, [], "too_old"),  # more than size missed
        (Since(9, "e"), read("e", 5, [1, 2, 3, 4, 5]), False, [], "ahead"),
    ],
)
def test_a_resume_is_recovered_only_when_every_missed_publication_is_kept(since, history, recovered, sent, reason):
    plan = plan_resume(since, history, POLICY, now_ms=1_000_000)
    assert (plan.recovered, [e.seq for e in plan.entries], plan.reason) == (recovered, sent, reason)


def test_a_publication_older_than_the_ttl_counts_as_gone():
    history = read("e", 5, [4, 5], ts=1_000_000)
    assert plan_resume(Since(3, "e"), history, POLICY, now_ms=1_000_000 + 60_000).recovered
    late = plan_resume(Since(3, "e"), history, POLICY, now_ms=1_000_000 + 60_001)
    assert (late.recovered, late.reason) == (False, "too_old")


@pytest.mark.parametrize(
    "value",
    [
        5,
        {"seq": -1, "epoch": "e"},
        {"seq": True, "epoch": "e"},
        {"seq": 1},
        {"seq": 1, "epoch": ""},
        {"seq": 1, "epoch": "x" * 65},
        {"seq": 1.5, "epoch": "e"},
        {"seq": 2**53, "epoch": "e"},
    ],
)
def test_since_is_validated(value):
    with pytest.raises(ValueError):
        Since.parse(value)


def test_history_is_declared_on_event_channels_only_and_bounded():
    registry = Registry()
    assert registry.add_channel("a", "event", history=POLICY).history == POLICY
    with pytest.raises(ConfigurationError):
        registry.add_channel("b", "state", history=POLICY)
    for bad in (
        {"history_size": -1},
        {"history_size": 10**6},
        {"history_size": 10, "history_ttl_s": 0},
        {"history_size": True},
    ):
        with pytest.raises(ConfigurationError):
            event_channel("demo:never", **bad)


def test_the_epoch_goes_after_seq_and_the_text_is_plain_json():
    text = notification_text("c", encode({"x": 1}), 7, 123, "abc")
    assert text == encode(
        {
            "jsonrpc": "2.0",
            "method": "message",
            "params": {"channel": "c", "data": {"x": 1}, "seq": 7, "epoch": "abc", "ts": 123},
        }
    )


async def test_messages_carry_the_epoch_and_a_reconnect_gets_what_it_missed_first(hub):
    async with Client() as publisher:
        async with Client() as c:
            first = (await c.call("subscribe", {"channel": "demo:events"}))["result"]
            assert first["kind"] == "event" and isinstance(first["epoch"], str) and "recovered" not in first
            for i in range(3):
                await publisher.call("publish", {"channel": "demo:events", "data": i})
            seen = await c.frames(3)
            assert [f["epoch"] for f in seen] == [first["epoch"]] * 3
            assert [f["seq"] for f in seen] == [first["seq"] + 1, first["seq"] + 2, first["seq"] + 3]
        last = seen[-1]
        for i in range(3, 8):  # published while away
            await publisher.call("publish", {"channel": "demo:events", "data": i})
        async with Client() as c:
            answer_id = await c.call_nowait(
                "subscribe", {"channel": "demo:events", "since": {"seq": last["seq"], "epoch": last["epoch"]}}
            )
            replayed = await c.frames(5)
            answer = await c.recv()
            assert answer["id"] == answer_id
            assert answer["result"]["recovered"] is True and answer["result"]["replayed"] == 5
            assert [f["data"] for f in replayed] == [3, 4, 5, 6, 7]
            assert [f["seq"] for f in replayed] == list(range(last["seq"] + 1, last["seq"] + 6))
            await publisher.call("publish", {"channel": "demo:events", "data": "live"})
            assert (await c.frames(1))[0]["data"] == "live"
            assert hub.probe()["history"]["recoveries"]["served"] == 1
            assert hub.probe()["history"]["replayed"] == 5


async def test_a_resume_too_old_or_of_another_epoch_is_not_recovered(hub):
    async with Client() as c:
        first = (await c.call("subscribe", {"channel": "test:short-history"}))["result"]
        for i in range(8):
            await hub.publish("test:short-history", i)
        await c.frames(8)
        too_old = await c.call(
            "subscribe", {"channel": "test:short-history", "since": {"seq": first["seq"], "epoch": first["epoch"]}}
        )
        assert too_old["result"]["recovered"] is False and too_old["result"]["reason"] == "too_old"
        assert too_old["result"]["seq"] == first["seq"] + 8 and too_old["result"]["epoch"] == first["epoch"]
        other = await c.call("subscribe", {"channel": "test:short-history", "since": {"seq": 1, "epoch": "nope"}})
        assert other["result"]["recovered"] is False and other["result"]["reason"] == "epoch_changed"
        since = {"seq": first["seq"] + 3, "epoch": first["epoch"]}
        await c.call_nowait("subscribe", {"channel": "test:short-history", "since": since})
        assert [f["data"] for f in await c.frames(5)] == [3, 4, 5, 6, 7]  # a resume while subscribed
        kept = await c.recv()
        assert kept["result"]["recovered"] is True and kept["result"]["replayed"] == 5
        assert hub.probe()["history"]["recoveries"] == {"served": 1, "failed": 2, "deferred": 0}
        assert hub.probe()["history"]["channels"]["test:short-history"]["kept"] == 5


async def test_bad_since_is_invalid_params_and_a_channel_without_history_says_so(hub):
    async with Client() as c:
        bad = await c.call("subscribe", {"channel": "demo:events", "since": {"seq": "x", "epoch": "e"}})
        assert bad["error"]["code"] == -32602 and bad["error"]["data"]["reason"] == "invalid_since"
        assert "demo:events" not in hub.subscribers  # nothing half-done
        none = (await c.call("subscribe", {"channel": "test:events", "since": {"seq": 1, "epoch": "e"}}))["result"]
        assert none["recovered"] is False and none["reason"] == "no_history" and "epoch" not in none
        assert (await c.call("ping"))["result"] == "pong"


async def test_live_publications_during_a_replay_come_after_it_in_order_none_twice():
    async with gated_hub() as hub:
        async with Client() as c:
            first = (await c.call("subscribe", {"channel": "demo:events"}))["result"]
            for i in range(4):
                await hub.publish("demo:events", i)
            await c.frames(4)
        for i in range(4, 10):  # missed
            await hub.publish("demo:events", i)
        shut_gate()
        async with Client() as c:
            since = {"seq": first["seq"] + 4, "epoch": first["epoch"]}
            await c.call_nowait("subscribe", {"channel": "demo:events", "since": since})
            await asyncio.wait_for(GatedHistory.reading.wait(), 5)
            for i in range(10, 15):  # live while the history is being read
                await hub.publish("demo:events", i)
            GatedHistory.gate.set()
            got = [f["data"] for f in await c.frames(11)]
            assert got == list(range(4, 15))
            answer = await c.recv()
            assert answer["result"]["recovered"] is True and answer["result"]["replayed"] == 6
            await hub.publish("demo:events", 15)
            assert [f["data"] for f in await c.frames(1)] == [15]


async def test_past_max_concurrent_resumes_a_resume_is_refused_to_come_back_and_then_served():
    """MAX_CONCURRENT_RESUMES (no test named it): while one resume replays, another client's
    is refused -32003 too_many_resumes with retry_after_ms; it is served once it retries.
    Both are longer than SHORT_RESUME (a short one is not queued: the next test)."""
    from realtime_app.hub.replay import SHORT_RESUME

    gap = SHORT_RESUME + 5
    async with gated_hub(MAX_CONCURRENT_RESUMES=1) as hub:
        async with Client() as c:
            first = (await c.call("subscribe", {"channel": "demo:events"}))["result"]
            for i in range(gap):
                await hub.publish("demo:events", i)
            since = {"seq": first["seq"], "epoch": first["epoch"]}
            shut_gate()
            async with Client() as a, Client() as b:
                await a.call_nowait("subscribe", {"channel": "demo:events", "since": since})
                await asyncio.wait_for(GatedHistory.reading.wait(), 5)  # a's replay holds the one slot
                refused = await b.call("subscribe", {"channel": "demo:events", "since": since})
                assert refused["error"]["code"] == -32003, refused
                assert refused["error"]["data"]["reason"] == "too_many_resumes"
                assert refused["error"]["data"]["limit"] == 1 and refused["error"]["data"]["retry_after_ms"] > 0
                GatedHistory.gate.set()
                assert [f["data"] for f in await a.frames(gap)] == list(range(gap))
                answer = await b.call("subscribe", {"channel": "demo:events", "since": since})  # its retry
                assert answer["result"]["recovered"] is True and answer["result"]["replayed"] == gap
                assert hub.replays.resuming == 0  # every slot given back


async def test_a_short_resume_is_not_queued_behind_long_ones():
    """Found (a rolling restart of 4,500 clients): every client of a stopped process resumed
    a few seconds' worth of publications, 8 at a time per process, the rest refused for a
    second, round after round: the last held every publication 11-13 s after the last
    process was back. A resume within SHORT_RESUME publications of the process's position
    costs what a subscribe costs and is admitted while long ones hold every slot."""
    from realtime_app.hub.replay import SHORT_RESUME
    from tests.support.waiting import eventually

    gap = SHORT_RESUME + 5
    async with gated_hub(MAX_CONCURRENT_RESUMES=1) as hub:
        async with Client(address="10.91.0.1") as c:
            first = (await c.call("subscribe", {"channel": "demo:events"}))["result"]
            for i in range(gap):
                await hub.publish("demo:events", i)
            top = hub.last_seq["demo:events"]
            shut_gate()
            async with Client(address="10.91.0.2") as long, Client(address="10.91.0.3") as short:
                since = {"seq": first["seq"], "epoch": first["epoch"]}
                await long.call_nowait("subscribe", {"channel": "demo:events", "since": since})
                await asyncio.wait_for(GatedHistory.reading.wait(), 5)  # the long one holds the one slot
                assert hub.replays.resuming == 1
                recent = {"seq": top - 3, "epoch": first["epoch"]}
                answer = asyncio.ensure_future(short.call("subscribe", {"channel": "demo:events", "since": recent}))
                await eventually(lambda: len(hub.replays.resuming_by) == 2, 5, "the short resume admitted")
                assert hub.replays.resuming == 1  # it takes no slot
                GatedHistory.gate.set()
                result = (await answer)["result"]
                assert result["recovered"] is True and result["replayed"] == 3, result
                assert [f["data"] for f in await long.frames(gap)] == list(range(gap))
            await eventually(lambda: hub.replays.resuming == 0 and not hub.replays.resuming_by, 5, "slots back")


async def test_a_resume_whose_publications_may_not_fit_one_read_is_queued_however_short():
    """Review: a resume was taken for short by its count alone — 64 publications of a
    channel bounded only by MAX_PUBLICATION_BYTES can be megabytes, many reads. A channel
    whose 64 publications may pass one read (PAGE_BYTES) is counted against the slots
    however few it is behind, and refused while they are held."""
    async with gated_hub(
        MAX_CONCURRENT_RESUMES=1,
        MAX_PUBLICATION_BYTES=1_000_000,  # the default: test:big-history declares no max_bytes
    ) as hub:
        async with Client(address="10.92.0.1") as c:
            first = (await c.call("subscribe", {"channel": "demo:events"}))["result"]
            big = (await c.call("subscribe", {"channel": "test:big-history"}))["result"]
            for i in range(3):
                await hub.publish("demo:events", i)
                await hub.publish("test:big-history", i)
            shut_gate()
            async with Client(address="10.92.0.2") as a, Client(address="10.92.0.3") as b:
                since = {"seq": first["seq"], "epoch": first["epoch"]}
                hub.replays.resuming = 1  # the one slot held, as by a long resume
                short = asyncio.ensure_future(a.call("subscribe", {"channel": "demo:events", "since": since}))
                assert hub.last_seq["test:big-history"] == big["seq"] + 3  # known here: 3 behind is near
                behind = {"seq": big["seq"], "epoch": big["epoch"]}  # 3 behind, each up to MAX_PUBLICATION_BYTES
                refused = await b.call("subscribe", {"channel": "test:big-history", "since": behind})
                assert refused["error"]["data"]["reason"] == "too_many_resumes", refused
                assert hub.replays.resuming == 1  # the refused one took nothing
                GatedHistory.gate.set()
                assert (await short)["result"]["replayed"] == 3  # demo:events: 64 × 4 KiB fit one read
                hub.replays.resuming = 0


async def test_a_resume_short_by_this_processs_position_but_long_by_its_read_takes_a_slot():
    """Review: a process behind its channel (its subscription lagging) took a resume for
    short by its own position while the read brought the whole gap. A resume the read shows
    longer than SHORT_RESUME takes a slot then, or is refused while they are held."""
    from realtime_app.hub import get_hub
    from realtime_app.hub.replay import SHORT_RESUME

    config = {**get_config(), "MAX_CONCURRENT_RESUMES": 1}
    with override_settings(REALTIME_APP=config):
        hub = await get_hub()
        try:
            async with Client(address="10.93.0.1") as c:
                first = (await c.call("subscribe", {"channel": "demo:events"}))["result"]
                for i in range(SHORT_RESUME + 5):
                    await hub.publish("demo:events", i)
                hub.last_seq["demo:events"] = first["seq"] + 3  # as if this process had seen only 3
                hub.replays.resuming = 1  # the one slot held
                async with Client(address="10.93.0.2") as a:
                    since = {"seq": first["seq"], "epoch": first["epoch"]}
                    refused = await a.call("subscribe", {"channel": "demo:events", "since": since})
                    assert refused["error"]["data"]["reason"] == "too_many_resumes", refused
                    assert hub.replays.resuming == 1 and not hub.replays.resuming_by  # nothing taken, all given back
                    assert len(hub.subscribers["demo:events"]) == 1  # a's subscription undone: c's is left
                    hub.replays.resuming = 0
                    answer = await a.call("subscribe", {"channel": "demo:events", "since": since})
                    assert answer["result"]["replayed"] == SHORT_RESUME + 5
                    assert len(hub.subscribers["demo:events"]) == 2  # c's, and a's now
                assert hub.replays.resuming == 0
        finally:
            await hub.aclose()


async def test_one_identity_holds_at_most_its_share_of_the_resume_slots():
    """Found: one address held all 8 resume slots by pipelining resumes into a socket it
    never read; a signed-in user's resume waited 21-25 s. An identity now holds at most
    MAX_RESUMES_PER_IDENTITY (2) of them: its third is refused, another identity's is
    admitted at once."""
    from tests.support.waiting import eventually

    async with gated_hub() as hub:
        async with Client() as c:
            first = (await c.call("subscribe", {"channel": "demo:events"}))["result"]
        await hub.publish("demo:events", 0)
        since = {"seq": first["seq"], "epoch": first["epoch"]}
        resume = {"channel": "demo:events", "since": since}
        GatedHistory.gate.clear()
        hog = [Client(address="10.66.0.1") for _ in range(3)]
        for client in hog:
            await client.__aenter__()
        try:
            async with Client(address="10.77.0.1") as other:
                await hog[0].call_nowait("subscribe", resume)
                await hog[1].call_nowait("subscribe", resume)
                replaying = lambda: sum(hub.replays.resuming_by.values())  # noqa: E731  (short ones too)
                await eventually(lambda: replaying() == 2, 5, "the hog's two resumes replaying")
                refused = await hog[2].call("subscribe", resume)
                assert refused["error"]["data"] == {
                    "reason": "too_many_resumes",
                    "limit": 2,
                    "retry_after_ms": refused["error"]["data"]["retry_after_ms"],
                }
                await other.call_nowait("subscribe", resume)
                await eventually(lambda: replaying() == 3, 5, "another identity's resume admitted")
                GatedHistory.gate.set()
                assert [f["data"] for f in await other.frames(1)] == [0]
                assert (await other.recv())["result"]["recovered"] is True
        finally:
            for client in hog:
                await client.__aexit__(None, None, None)
        await eventually(lambda: hub.replays.resuming == 0 and not hub.replays.resuming_by, 5, "slots given back")


async def test_the_probe_and_metrics_show_histories_and_resumes(hub):
    from realtime_app.observability.metrics import render

    async with Client() as c:
        start = (await c.call("subscribe", {"channel": "test:short-history"}))["result"]
        await hub.publish("test:short-history", "x")
        await c.frames(1)
        await c.call("subscribe", {"channel": "test:short-history", "since": {"seq": 0, "epoch": "gone"}})
    probe = hub.probe()["history"]
    assert probe["channels"]["test:short-history"] == {"epoch": start["epoch"], "kept": 1}
    assert probe["recoveries"] == {"served": 0, "failed": 1, "deferred": 0}
    text = render({"instances": [hub.probe()]}).decode()
    assert "realtime_history_recoveries_total{" in text and 'result="failed"' in text
    assert "realtime_history_kept{" in text and 'channel="test:short-history"' in text


async def test_a_process_fans_frames_out_in_seq_order_and_releases_over_a_gap_after_a_window(hub):
    from realtime_app.cluster.base import Delivery
    from realtime_app.hub.ordering import REORDER_WINDOW_S

    async with Client() as c:
        start = (await c.call("subscribe", {"channel": "demo:events"}))["result"]
        top, epoch = start["seq"], start["epoch"]

        def frame(seq):
            text = notification_text("demo:events", encode({"n": seq}), seq, 0, epoch)
            return Delivery("frame", "demo:events", text, seq, epoch)

        await hub._deliver(frame(top + 2))  # overtook top + 1
        await hub._deliver(frame(top + 1))
        assert [f["seq"] for f in await c.frames(2)] == [top + 1, top + 2]
        await hub._deliver(frame(top + 4))  # top + 3 never comes: released after the window
        loop = asyncio.get_running_loop()
        held_at = loop.time()
        assert [f["seq"] for f in await c.frames(1)] == [top + 4]
        assert loop.time() - held_at >= REORDER_WINDOW_S * 0.9
        assert hub.probe()["history"]["gaps"] == 1
        await hub._deliver(frame(top + 3))  # too late: dropped here (a client resumes it)
        await hub._deliver(frame(top + 5))
        assert [f["seq"] for f in await c.frames(1)] == [top + 5]


async def test_a_late_frame_still_reaches_a_connection_behind_the_process(hub):
    """Found in review: two first subscribes whose reads returned different tops (10, 11)
    set the process's next seq past 11, and the frame 11 was dropped for the connection
    at 10 — which only noticed at the next publication."""
    from realtime_app.cluster.base import Delivery

    async with Client() as c:
        start = (await c.call("subscribe", {"channel": "demo:events"}))["result"]
        top, epoch = start["seq"], start["epoch"]
        hub.ordering.forget("demo:events")
        hub.ordering.read("demo:events", epoch, top + 1)  # another subscriber's later read
        text = notification_text("demo:events", encode("late"), top + 1, 0, epoch)
        await hub._deliver(Delivery("frame", "demo:events", text, top + 1, epoch))
        assert [f["data"] for f in await c.frames(1)] == ["late"]
        await hub._deliver(Delivery("frame", "demo:events", text, top + 1, epoch))  # again: not twice
        await hub.publish("demo:events", "next")
        assert [f["data"] for f in await c.frames(1)] == ["next"]


async def test_a_failed_read_undoes_a_first_subscribe_and_keeps_a_resumed_one():
    from realtime_app.hub import get_hub

    with override_settings(REALTIME_APP={**get_config(), "BACKPLANE": "tests.testapp.backplanes.UnreadableHistory"}):
        hub = await get_hub()
        try:
            async with Client() as c:
                first = await c.call("subscribe", {"channel": "demo:events"})
                assert first["error"]["data"]["reason"] == "backplane_unavailable"
                assert "demo:events" not in hub.subscribers  # not half subscribed
                conn = next(iter(hub.connections))
                await hub.subscribe(conn, registry.resolve("demo:events"))  # subscribed before the outage
                resumed = await c.call("subscribe", {"channel": "demo:events", "since": {"seq": 1, "epoch": "e"}})
                assert resumed["error"]["data"]["reason"] == "backplane_unavailable"
                assert conn in hub.subscribers["demo:events"]  # frames go on; the client resumes again
        finally:
            await hub.aclose()


def test_a_resume_at_zero_of_a_lapsed_lineage_nothing_was_published_on_missed_nothing():
    """A channel only ever read keeps its count and epoch its history TTL (not a day): a
    client back later than that, which had seen nothing (seq 0), finds a new epoch that
    this very read started and nothing published — recovered, not epoch_changed."""
    policy = HistoryPolicy(10, 60)
    fresh = HistoryRead("0000000000002-b", 0, 0, [], created=True)
    assert plan_resume(Since(0, "0000000000001-a"), fresh, policy, 0).recovered
    assert plan_resume(Since(3, "0000000000001-a"), fresh, policy, 0).reason == "epoch_changed"  # it saw some
    kept = HistoryRead("0000000000002-b", 0, 0, [], created=False)  # a lineage that was there: another history
    assert plan_resume(Since(0, "0000000000001-a"), kept, policy, 0).reason == "epoch_changed"
