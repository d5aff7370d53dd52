"""The PostgreSQL backplane on a real PostgreSQL (the run's migrated database; a private
server for the restart): publications numbered and notified once, in ``seq`` order, to
every process that joined; large ones through the table; history read back by epoch and
``seq``; leases, presence, calls run once, probes and shared buckets kept for every process;
rows pruned past their end; a cut connection and a restart healed by themselves; every
connection closed by a stop, whatever step a cancel hits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
from typing import Any

import psycopg
import pytest
from django.test import override_settings

from realtime_app.cluster.base import Delivery
from realtime_app.cluster.postgres import PostgresBackplane, TablesMissing
from realtime_app.cluster.postgres_sql import INSTALL, NOTIFY_LIMIT
from realtime_app.wire.history import HistoryPolicy, Since
from realtime_app.wire.names import group_name
from realtime_app.wire.presence import LocalRoom, merge
from tests.support.postgres import TcpProxy, create_database, drop_database, with_port
from tests.support.private_postgres import PrivatePostgres
from tests.support.servers import ROOT
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(120)

DATA = '{"n":1,"s":"caf\\u00e9"}'
HISTORY = HistoryPolicy(size=5, ttl_s=60)


def libpq(url: str) -> str:
    return url.replace("postgres://", "postgresql://", 1)


@pytest.fixture
def database(postgres) -> str:
    """The run's migrated PostgreSQL database (the migration made the backplane's tables)."""
    return libpq(postgres[1])


@pytest.fixture
def prefix() -> str:
    return f"{os.environ['REALTIME_TEST_PREFIX']}-pg-{secrets.token_hex(3)}"


class Process:
    """A backplane receiving into a list, as one process of the cluster would."""

    def __init__(self, url: str, prefix: str, params: dict[str, Any] | None = None, **config: Any) -> None:
        self.backplane = PostgresBackplane(
            instance_id=f"pg-{secrets.token_hex(3)}",
            config={"KEY_PREFIX": prefix, "LEASE_TTL_MS": 1000, **config},
            params={"conninfo": url, **(params or {})},
        )
        self.got: list[Delivery] = []

    async def deliver(self, delivery: Delivery) -> None:
        self.got.append(delivery)

    async def __aenter__(self) -> Process:
        await self.backplane.start(self.deliver)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.backplane.stop()

    async def until(self, n: int, timeout: float = 15) -> list[Delivery]:
        await eventually(lambda: len(self.got) >= n, timeout, f"{n} deliveries")
        return self.got


def sql(url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cursor = conn.execute(query, params)
        return cursor.fetchall() if cursor.description else []


async def test_publications_reach_every_subscribed_process_once_in_seq_order(database, prefix) -> None:
    async with Process(database, prefix) as a, Process(database, prefix) as b, Process(database, prefix) as pub:
        await a.backplane.join(["wire:a"])
        await b.backplane.join(["wire:a"])
        seqs = await asyncio.gather(*(pub.backplane.publish("wire:a", DATA) for _ in range(200)))
        assert sorted(seqs) == list(range(1, 201))
        for process in (a, b):
            got = await process.until(200)
            assert [d.seq for d in got] == list(range(1, 201))  # in seq order, each once
            assert (got[0].kind, got[0].channel, got[0].epoch) == ("frame", "wire:a", "")
            assert json.loads(got[0].text)["params"] == {**json.loads(got[0].text)["params"], "seq": 1}
        assert pub.got == []  # a process that did not join gets nothing
        # larger than a NOTIFY carries: through the table, whole, in its place in the order
        big = json.dumps("x" * (NOTIFY_LIMIT + 100))
        assert await pub.backplane.publish("wire:a", big, floor=500) == 501
        assert await pub.backplane.publish("wire:a", DATA) == 502
        for process in (a, b):
            got = await process.until(202)
            assert [d.seq for d in got[200:]] == [501, 502]
            assert json.loads(got[200].text)["params"]["data"] == json.loads(big)
        # a process that left gets nothing more; the other still does
        await a.backplane.leave("wire:a")
        await pub.backplane.publish("wire:a", DATA)
        await b.until(203)
        await pub.backplane.publish("wire:a", DATA)
        await b.until(204)
        assert len(a.got) == 202


async def test_a_kept_publication_carries_its_epoch_and_is_read_back_a_bounded_page_at_a_time(database, prefix) -> None:
    async with Process(database, prefix) as a, Process(database, prefix) as b:
        await b.backplane.join(["kept:a"])
        seqs = [await a.backplane.publish("kept:a", json.dumps("y" * 100), history=HISTORY) for _ in range(8)]
        assert seqs == list(range(1, 9))
        got = await b.until(8)
        epoch = got[0].epoch
        assert epoch and all(d.epoch == epoch for d in got)
        assert json.loads(got[-1].text)["params"]["epoch"] == epoch
        read = await b.backplane.history("kept:a", HISTORY, Since(5, epoch))
        assert (read.epoch, read.top, read.size, read.created) == (epoch, 8, 5, False)
        assert [e.seq for e in read.entries] == [6, 7, 8]
        assert read.entries[0].text == got[5].text
        # a page is bounded in bytes, and holds one entry at least
        one = len(got[0].text.encode())
        assert [e.seq for e in await b.backplane.history_page("kept:a", 3, 10, max_bytes=2 * one)] == [4, 5]
        assert [e.seq for e in await b.backplane.history_page("kept:a", 3, 10, max_bytes=1)] == [4]
        # more than the history keeps, or another epoch: no entries
        assert (await b.backplane.history("kept:a", HISTORY, Since(1, epoch))).entries == []
        assert (await b.backplane.history("kept:a", HISTORY, Since(5, "0" * 19))).entries == []
        # a channel never published: a new epoch at seq 0, nothing kept
        fresh = await b.backplane.history("kept:new", HISTORY)
        assert (fresh.top, fresh.size, fresh.created) == (0, 0, True)


async def test_one_lease_holder_and_a_release_told_to_the_others_not_to_itself(database, prefix) -> None:
    async with Process(database, prefix) as a, Process(database, prefix) as b:
        await a.backplane.join(["tick:a"])
        await b.backplane.join(["tick:a"])
        assert await a.backplane.acquire("tick:a")
        assert not await b.backplane.acquire("tick:a")
        assert not await b.backplane.renew("tick:a")
        assert await a.backplane.renew("tick:a")
        assert await a.backplane.lease_holder("tick:a") == a.backplane.instance_id
        await a.backplane.release("tick:a")
        got = await b.until(1)
        assert (got[0].kind, got[0].channel, got[0].text) == ("released", "tick:a", a.backplane.instance_id)
        assert a.got == []
        # a lease not renewed lapses: another process takes it (failover)
        assert await b.backplane.acquire("tick:a")
        await eventually(lambda: a.backplane.acquire("tick:a"), timeout=10, what="the lapsed lease taken")
        assert await a.backplane.lease_holder("tick:a") == a.backplane.instance_id


def part(*users: str) -> str:
    room = LocalRoom()
    for n, user in enumerate(users):
        room.enter(n, user)
    return room.part(0)


async def test_presence_of_two_processes_merges_and_a_dead_ones_parts_go_with_its_mark(database, prefix) -> None:
    async with Process(database, prefix) as a, Process(database, prefix) as b:
        rooms = [f"room:{n}" for n in range(3)]
        assert (await a.backplane.presence_alive(1000))[1] is False  # a first mark
        assert (await a.backplane.presence_alive(1000))[1] is True
        await a.backplane.put_presence({r: part("ann") for r in rooms}, 60_000, alive=True)
        await b.backplane.put_presence({r: part("bob") for r in rooms}, 60_000)
        seen = await b.backplane.read_presence({r: "" for r in rooms})
        version, parts = seen["room:0"]  # type: ignore[misc]
        assert sorted(merge(parts).users) == ["ann", "bob"]
        # the same parts written again change nothing a reader sees
        await b.backplane.put_presence({r: part("bob") for r in rooms}, 60_000)
        assert (await a.backplane.read_presence({"room:0": version}))["room:0"] is None

        # a's mark lapses (a killed process): its parts go, a reader holding the version sees it
        async def gone() -> bool:
            answer = (await b.backplane.read_presence({"room:0": version}))["room:0"]
            return answer is not None and sorted(merge(answer[1]).users) == ["bob"]

        await eventually(gone, timeout=10, what="a's parts gone with its alive mark")
        # the last part gone: nothing left of the room
        await b.backplane.put_presence({r: None for r in rooms}, 60_000)
        left = sql(database, "SELECT count(*) FROM realtime_app_bp_presence WHERE channel LIKE %s", [f"{prefix}:%"])
        assert left == [(0,)]


async def test_calls_run_once_outbox_rows_probes_and_buckets_are_one_book_for_every_process(database, prefix) -> None:
    async with Process(database, prefix) as a, Process(database, prefix) as b:
        assert await a.backplane.claim_once("once:k", "o1", 5000) == ("run", None)
        assert await b.backplane.claim_once("once:k", "o2", 5000) == ("running", None)
        await b.backplane.keep_once("once:k", "o2", "not mine", 5000)  # not its claim: nothing kept
        assert await b.backplane.claim_once("once:k", "o2", 5000) == ("running", None)
        await a.backplane.keep_once("once:k", "o1", '{"ok":1}', 5000)
        assert await b.backplane.claim_once("once:k", "o2", 5000) == ("answer", '{"ok":1}')
        # an outbox row published once within the window, whichever process drains it
        assert await a.backplane.publish_once("out:a", DATA, 0, HISTORY, "row-1", 5000) == 1
        assert await b.backplane.publish_once("out:a", DATA, 0, HISTORY, "row-1", 5000) is None
        assert await b.backplane.publish_once("out:a", DATA, 0, HISTORY, "row-2", 5000) == 2
        # the cluster view: each process lists the others' probes
        await a.backplane.put_probe({"instance": a.backplane.instance_id}, 5000)  # type: ignore[typeddict-item]
        assert [p["instance"] for p in await b.backplane.cluster_probes()] == [a.backplane.instance_id]
        assert await a.backplane.cluster_probes() == []
        await a.backplane.drop_probe()
        assert await b.backplane.cluster_probes() == []
        # one bucket for the identity wherever it calls
        assert await a.backplane.take_tokens("who", 1, 2, 0.5) is None
        assert await b.backplane.take_tokens("who", 1, 2, 0.5) is None
        wait = await a.backplane.take_tokens("who", 1, 2, 0.5)
        assert wait is not None and 1000 <= wait <= 2100


async def test_rows_past_their_end_are_pruned_a_bounded_batch_at_a_time(database, prefix) -> None:
    async with Process(database, prefix, SEQ_IDLE_TTL_MS=1000) as a:
        # what an anonymous flood leaves behind: channels read once, buckets, claims, presence
        short = HistoryPolicy(size=3, ttl_s=1)
        for n in range(50):
            await a.backplane.history(f"flood:{n}", short)
            await a.backplane.publish(f"plain:{n}", DATA)
            await a.backplane.take_tokens(f"who-{n}", 1, 2, 10)
            await a.backplane.claim_once(f"once:{n}", "o", 300)
        await a.backplane.publish("kept:b", DATA, history=short)
        await a.backplane.put_presence({"room:p": part("ann")}, 300)
        like = f"{prefix}:%"
        lineage = a.backplane.key("seq", "kept:b")  # a lineage outlives its history (a day): kept
        counted = (
            "SELECT (SELECT count(*) FROM realtime_app_bp_channel WHERE name LIKE %(p)s AND name <> %(l)s)"
            " + (SELECT count(*) FROM realtime_app_bp_key WHERE scope LIKE %(p)s)"
            " + (SELECT count(*) FROM realtime_app_bp_history WHERE channel LIKE %(p)s)"
            " + (SELECT count(*) FROM realtime_app_bp_presence WHERE channel LIKE %(p)s)"
        )
        assert sql(database, counted, {"p": like, "l": lineage})[0][0] > 150

        async def pruned() -> bool:
            await a.backplane.prune()
            return sql(database, counted, {"p": like, "l": lineage})[0][0] == 0

        await eventually(pruned, timeout=15, what="every row of the flood pruned")


async def test_a_cut_connection_heals_by_itself_and_the_next_check_says_so(postgres, prefix) -> None:
    server = libpq(postgres[1])
    port = int(server.rsplit(":", 1)[1].split("/")[0])
    proxy = TcpProxy(port).restore()
    try:
        async with Process(libpq(with_port(postgres[1], proxy.port)), prefix) as a, Process(server, prefix) as pub:
            await a.backplane.join(["heal:a"])
            await pub.backplane.publish("heal:a", DATA)
            await a.until(1)
            assert await a.backplane.check() is False  # a first sentinel
            assert await a.backplane.check() is True
            proxy.cut()
            with pytest.raises(a.backplane.errors):
                await a.backplane.publish("heal:a", DATA)
            await eventually(lambda: a.backplane.outage.down, timeout=10, what="the outage seen")
            proxy.restore()

            # the listening connection comes back listening to what it had joined
            async def delivered() -> bool:
                await pub.backplane.publish("heal:a", DATA)
                return len(a.got) >= 2

            await eventually(delivered, timeout=20, what="a publication delivered after the cut")
            assert await a.backplane.check() is False  # the hub re-asserts after a reconnect
            assert await a.backplane.check() is True
    finally:
        proxy.cut()


async def reassert_asked(process: Process, timeout: float = 30) -> None:
    """Wait until a check answers False: the hub would re-assert (join, reseed, leases)."""

    async def asked() -> bool:
        try:
            return await process.backplane.check() is False
        except process.backplane.errors:
            return False

    await eventually(asked, timeout=timeout, what="a check asking for a re-assert")


async def test_a_clean_restart_keeps_histories_and_a_crash_begins_new_epochs_counts_going_on(prefix) -> None:
    """A clean restart loses no commit: the epoch goes on and a resume across it is served.
    A crash may have lost the last commits (synchronous_commit is off): a new epoch.
    Found: the postmaster's start time, the first run token, stays when a backend crash
    makes the server recover, so a count that went back numbered two publications alike."""
    server = PrivatePostgres().start()
    try:
        url = libpq(server.url)
        sql(url, INSTALL)
        async with Process(url, prefix) as a, Process(url, prefix) as pub:
            await a.backplane.join(["restart:a", "restart:k"])
            await pub.backplane.publish("restart:a", DATA)
            await pub.backplane.publish("restart:k", DATA, history=HISTORY)
            got = await a.until(2)
            epoch = got[1].epoch
            assert await a.backplane.check() is False and await a.backplane.check() is True
            for stop in ("fast", "immediate"):
                await asyncio.to_thread(server.restart, stop)
                await reassert_asked(a)  # the listening connection came back: the hub re-asserts
                seen = len(a.got)

                async def delivered(seen: int = seen) -> bool:
                    with contextlib.suppress(*pub.backplane.errors):
                        await pub.backplane.publish("restart:a", DATA)
                    return any(d.channel == "restart:a" for d in a.got[seen:])

                await eventually(delivered, timeout=30, what=f"a publication delivered after a {stop} restart")
                frames = [d.seq for d in a.got if d.channel == "restart:a"]
                assert frames == sorted(set(frames)), frames  # the count went on, never back
                kept = await pub.backplane.publish("restart:k", DATA, history=HISTORY)
                read = await pub.backplane.history("restart:k", HISTORY, Since(1, epoch))
                if stop == "fast":  # nothing lost: the same history, resumed across the restart
                    assert kept == 2 and read.epoch == epoch and [e.seq for e in read.entries] == [2]
                else:  # a crash may have lost the last commits (the count too): a new history
                    assert read.epoch > epoch and read.entries == []
    finally:
        server.close()


def backplane_connections(url: str, prefix: str) -> int:
    return sql(
        url,
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
        [f"realtime_app backplane {prefix}"],
    )[0][0]


@pytest.mark.parametrize("step", range(6))
async def test_a_stop_cancelled_at_any_step_still_closes_every_connection(database, prefix, step) -> None:
    process = Process(database, prefix, params={"application_name": f"realtime_app backplane {prefix}"})
    async with process:
        await process.backplane.join(["stop:a"])
        await process.backplane.publish("stop:a", DATA)
        await process.until(1)
        assert backplane_connections(database, prefix) >= 2  # listening, and the pool's
        stop = asyncio.ensure_future(process.backplane.stop())
        for _ in range(step):
            await asyncio.sleep(0)
        stop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stop
    await eventually(lambda: backplane_connections(database, prefix) == 0, timeout=10, what="no connection left")


@override_settings(REALTIME_APP={"BACKPLANE": "postgres"})
def test_the_postgres_backplane_on_a_database_that_is_not_postgresql_is_check_e016():
    from realtime_app.checks.configuration import check_settings

    found = [m for m in check_settings() if m.id == "realtime_app.E016"]
    assert len(found) == 1 and "'default' is not a PostgreSQL one" in found[0].msg  # the tests' SQLite
    with override_settings(REALTIME_APP={"BACKPLANE": "postgres", "BACKPLANE_DATABASE": "nope"}):
        assert ["not in DATABASES" in m.msg for m in check_settings() if m.id == "realtime_app.E016"] == [True]


def test_the_online_check_names_missing_tables_and_a_database_too_small_for_the_processes(postgres):
    from realtime_app.cluster.online_checks import postgres_problem

    migrated = {"conninfo": libpq(postgres[1])}
    assert postgres_problem(migrated, 8, 4) is None
    too_many = postgres_problem(migrated, 100_000, 4)
    assert too_many is not None and "POSTGRES_MAX_PROCESSES 100000 processes need 600000" in too_many
    bare = postgres_problem({"conninfo": libpq(postgres[0])}, 1, 1)  # the server's own database: not migrated
    assert bare is not None and "run manage.py migrate" in bare
    port = int(postgres[0].rsplit(":", 1)[1].split("/")[0])
    proxy = TcpProxy(port)  # never started: nothing listens there
    gone = postgres_problem({"conninfo": libpq(with_port(postgres[1], proxy.port))}, 1, 1)
    assert gone is not None and gone.startswith("does not answer")


def test_the_online_check_of_a_deployment_says_e017_from_the_command_line(postgres):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": postgres[1],
        "REALTIME_BACKPLANE": "postgres",
        "REDIS_URL": "",
        "REALTIME_TEST_OVERRIDES": json.dumps({"POSTGRES_MAX_PROCESSES": 100_000}),
    }
    command = [sys.executable, "manage.py", "check", "--tag", "realtime_backplane"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "realtime_app.E017" in done.stderr, done.stderr
    env["REALTIME_TEST_OVERRIDES"] = "{}"
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


async def test_a_database_without_the_tables_is_refused_at_start_with_what_to_run(postgres, prefix):
    process = Process(libpq(postgres[0]), prefix)  # the server's own database: never migrated
    with pytest.raises(TablesMissing, match="run manage.py migrate"):
        await process.backplane.start(process.deliver)
    await process.backplane.stop()


async def test_no_publication_is_lost_while_the_process_joins_other_channels(database, prefix) -> None:
    """Found: the receiver broke out of a packet of notifications to run a LISTEN, and the
    rest of the packet was dropped — 561 of 3,000 publications lost while joining 200 channels."""
    async with Process(database, prefix) as a, Process(database, prefix) as pub:
        await a.backplane.join(["busy:a"])

        async def publisher(n: int) -> None:
            for _ in range(n):
                await pub.backplane.publish("busy:a", DATA)

        async def joiner() -> None:
            for n in range(200):
                await a.backplane.join([f"other:{n}"])

        await asyncio.gather(*(publisher(375) for _ in range(8)), joiner())
        got = await a.until(3000, timeout=30)
        assert sorted(d.seq for d in got if d.channel == "busy:a") == list(range(1, 3001))


async def test_a_join_cancelled_while_its_listen_runs_leaves_the_next_join_answered(database, prefix) -> None:
    """Found: a caller cancelled while its LISTEN ran made the receiver fail on its future,
    and the commands after it were dropped: their callers waited for ever."""
    async with Process(database, prefix) as a, Process(database, prefix) as pub:
        many = [f"many:{n}" for n in range(10_000)]  # LISTEN of 10,000 names takes a while
        slow = asyncio.ensure_future(a.backplane.join(many))
        after = asyncio.ensure_future(a.backplane.join(["room:y"]))
        listener = a.backplane._listener
        assert listener is not None
        pid = listener.info.backend_pid

        def listening_now() -> bool:
            rows = sql(database, "SELECT query FROM pg_stat_activity WHERE pid = %s AND state = 'active'", [pid])
            return bool(rows) and rows[0][0].startswith("LISTEN")

        await eventually(listening_now, timeout=10, what="the LISTEN under way")
        slow.cancel()
        await asyncio.wait_for(after, 15)  # answered, not left waiting
        await pub.backplane.publish("room:y", DATA)
        got = await a.until(1)
        assert got[0].channel == "room:y"


async def test_the_check_asks_for_a_re_assert_every_interval(database, prefix) -> None:
    """Found: the sentinel was written again by every check, so it never lapsed and the
    periodic re-assert (join again, reseed) never came; it is written only when absent."""
    async with Process(database, prefix, REASSERT_INTERVAL_MS=1000) as a:
        assert await a.backplane.check() is False
        assert await a.backplane.check() is True

        async def asked_again() -> bool:
            return await a.backplane.check() is False

        await eventually(asked_again, timeout=10, what="the sentinel lapsed after the interval")


async def test_two_drains_of_one_outbox_row_at_once_publish_it_once(database, prefix) -> None:
    """Found: the dedupe book read the row's key before writing it, so a second drain that
    waited for the first's commit published the row again."""
    async with Process(database, prefix) as b:
        first = await psycopg.AsyncConnection.connect(database)  # a transaction held open
        try:
            args = [b.backplane.key("seq", "out:b"), b.backplane.notify_channel("out:b"), "abcdefgh", 86_400_000, 0]
            done = b.backplane.scope(f"outbox-done:{group_name('out:b')}")
            args += ['{"x":1', 1, HISTORY.size, HISTORY.ttl_ms, done, "row-1", 5000]
            placeholders = ", ".join(["%s"] * len(args))
            await first.execute(f"SELECT * FROM realtime_app_bp_publish_kept_once({placeholders})", args)
            second = asyncio.ensure_future(b.backplane.publish_once("out:b", DATA, 0, HISTORY, "row-1", 5000))
            await eventually(
                lambda: sql(database, "SELECT count(*) FROM pg_locks WHERE NOT granted")[0][0] > 0,
                timeout=10,
                what="the second drain waiting for the first",
            )
            await first.commit()
            assert await asyncio.wait_for(second, 10) is None
        finally:
            await first.close()


async def test_a_presence_write_that_waited_for_a_room_being_emptied_keeps_its_version(database, prefix) -> None:
    """Found: a write that waited for the room's lock while another emptied it went on
    without the lock and without a version row: readers holding a version then never saw
    its member leave."""
    async with Process(database, prefix) as a, Process(database, prefix) as b:
        await a.backplane.put_presence({"room:v": part("ann")}, 60_000)
        key = a.backplane.key("presence", "room:v")
        emptier = await psycopg.AsyncConnection.connect(database)
        try:  # the room locked by a writer that is about to take a's last part away
            await emptier.execute(
                "SELECT 1 FROM realtime_app_bp_presence WHERE channel = %s AND member = '~v' FOR UPDATE", [key]
            )
            writer = asyncio.ensure_future(b.backplane.put_presence({"room:v": part("bob")}, 60_000))
            await eventually(
                lambda: sql(database, "SELECT count(*) FROM pg_locks WHERE NOT granted")[0][0] > 0,
                timeout=10,
                what="the write waiting for the room",
            )
            await emptier.execute(
                "SELECT realtime_app_bp_presence_put(%s, %s, '', 60000, %s)",
                [key, a.backplane.instance_id, a.backplane.scope("presence-alive")],
            )
            await emptier.commit()  # the room and its version row gone while the write waited
            await asyncio.wait_for(writer, 10)
        finally:
            await emptier.close()
        version, parts = (await a.backplane.read_presence({"room:v": ""}))["room:v"]  # type: ignore[misc]
        assert version != "0" and sorted(merge(parts).users) == ["bob"]
        await b.backplane.put_presence({"room:v": None}, 60_000)
        assert (await a.backplane.read_presence({"room:v": version}))["room:v"] == ("0", [])


async def test_an_idle_pool_connection_is_reused_past_descriptor_1024(database, prefix) -> None:
    """Found: the staleness probe used select(), which refuses descriptors past 1,023, and
    took that for a stale connection: past 1,000 sockets, every call opened a connection."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        async with Process(database, prefix) as a:
            pids = {(await a.backplane.pool.one("SELECT pg_backend_pid()"))[0] for _ in range(20)}
            assert len(pids) == 1, pids
    finally:
        for fd in held:
            os.close(fd)


def test_the_online_check_takes_a_database_whose_options_set_a_connect_timeout(postgres):
    from realtime_app.cluster.online_checks import postgres_problem

    assert postgres_problem({"conninfo": libpq(postgres[1]), "connect_timeout": 5}, 8, 4) is None


async def test_a_listening_connection_gone_silent_is_replaced_within_a_few_beats(postgres, prefix) -> None:
    """Found: a listening connection a NAT or proxy dropped without closing kept a process
    deaf for minutes while its pool answered and its probe said "up". Each check echoes to
    it; silent past a few beats, it is replaced."""
    port = int(postgres[1].rsplit(":", 1)[1].split("/")[0])
    proxy = TcpProxy(port).restore()
    server = libpq(postgres[1])
    try:
        config = {"POSTGRES_TIMEOUT_MS": 1000}
        async with (
            Process(libpq(with_port(postgres[1], proxy.port)), prefix, **config) as a,
            Process(server, prefix) as pub,
        ):
            await a.backplane.join(["silent:a"])
            await pub.backplane.publish("silent:a", DATA)
            await a.until(1)
            proxy.freeze()  # every connection open now goes silent; new ones pass

            async def heard_again() -> bool:
                with contextlib.suppress(*a.backplane.errors):  # the frozen pool connection times out once
                    await a.backplane.check()  # the hub's beat
                await pub.backplane.publish("silent:a", DATA)
                return len(a.got) > 1

            await eventually(heard_again, timeout=30, what="a publication heard after the freeze")
    finally:
        proxy.cut()


async def test_a_database_that_ends_idle_sessions_loses_nothing(postgres, prefix) -> None:
    """Found: a database with ``idle_session_timeout`` (managed ones set it) ended the idle
    listening connection every few seconds, and what was sent meanwhile was lost."""
    name = f"{postgres[1].rsplit('/', 1)[1]}_idle"
    url = libpq(create_database(postgres[0], name))
    try:
        sql(url, INSTALL)
        sql(url, f"ALTER DATABASE \"{name}\" SET idle_session_timeout = '500ms'")
        async with Process(url, prefix) as a, Process(url, prefix) as pub:
            await a.backplane.join(["idle:a"])
            listener = a.backplane._listener
            assert listener is not None
            pid = listener.info.backend_pid
            for n in range(10):  # spread over more than the timeout, idle between
                await pub.backplane.publish("idle:a", DATA)
                await asyncio.sleep(0.2 if n % 3 else 0.7)
            got = await a.until(10)
            assert [d.seq for d in got] == list(range(1, 11))
            assert a.backplane._listener is not None and a.backplane._listener.info.backend_pid == pid
    finally:
        drop_database(postgres[0], name)


def manage(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "REDIS_URL": "", **env}
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=180
    )


def test_the_online_check_says_what_the_offline_checks_would(tmp_path):
    """Found: ``check --tag realtime_backplane``, the command the docs give, said "no issues"
    for a misspelled backplane and connected to an SQLite path as a database name."""
    env = {"DATABASE_URL": f"sqlite:///{tmp_path}/db.sqlite3", "REALTIME_BACKPLANE": "postgres"}
    done = manage(env, "check", "--tag", "realtime_backplane")
    assert done.returncode != 0 and "realtime_app.E016" in done.stderr and "does not answer" not in done.stderr


def test_a_rollback_of_the_migration_leaves_nothing_and_a_publication_says_to_migrate(postgres):
    """Found: rolling the migration back left every function: the backplane started, then
    failed each call on a missing table."""
    name = f"{postgres[1].rsplit('/', 1)[1]}_rollback"
    url = create_database(postgres[0], name)
    env = {"DATABASE_URL": url, "REALTIME_BACKPLANE": "postgres"}
    leftovers = "SELECT count(*) FROM pg_proc WHERE left(proname, 16) = 'realtime_app_bp_'"
    try:
        assert manage(env, "migrate", "--noinput", "-v", "0").returncode == 0
        assert sql(libpq(url), leftovers)[0][0] > 10
        assert manage(env, "migrate", "realtime_app", "0004", "--noinput", "-v", "0").returncode == 0
        assert sql(libpq(url), leftovers) == [(0,)]
        assert sql(libpq(url), "SELECT to_regclass('realtime_app_bp_key')") == [(None,)]
        done = manage(env, "shell", "-c", "from realtime_app import publish; publish('demo:events', {'x': 1})")
        assert done.returncode != 0 and "run manage.py migrate" in done.stderr, done.stderr[-2000:]
    finally:
        drop_database(postgres[0], name)


def test_a_project_on_psycopg2_is_told_the_backplane_needs_psycopg_3(postgres, tmp_path):
    """Found: a project on psycopg2 (Django runs on either) got a traceback from every
    command once it set the backplane; it is check E016, and the hub does not start."""
    blocked = tmp_path / "without-psycopg3"
    blocked.mkdir()
    (blocked / "psycopg.py").write_text("raise ImportError(\"No module named 'psycopg'\")\n")
    env = {"DATABASE_URL": postgres[1], "REALTIME_BACKPLANE": "postgres", "PYTHONPATH": f"{blocked}:{ROOT}"}
    done = manage(env, "check")
    assert done.returncode != 0 and "realtime_app.E016" in done.stderr and "needs psycopg 3" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("setting", "check_id"),
    [({"BACKPLANE": "postgress"}, "realtime_app.E003"), ({"BACKPLANE": "postgres"}, "realtime_app.E016")],
)
async def test_a_server_on_a_wrong_backplane_setting_says_the_check_once_and_answers_1013(setting, check_id):
    """Found: under daphne (which runs no checks) a misspelled backplane or a database that
    is not PostgreSQL's showed only as a traceback per connection; the checks' errors are
    now said before the backplane is made, and the hub's start fails as an outage would
    (1013 to the client), naming the check."""
    from realtime_app.conf import get_config
    from realtime_app.conf.runtime import reset_runtime, runtime
    from realtime_app.exceptions import BackplaneUnavailable
    from realtime_app.hub.hubs import get_hub

    old = runtime()
    fresh = reset_runtime()
    try:
        with override_settings(REALTIME_APP={**get_config(), **setting}):
            with pytest.raises(BackplaneUnavailable, match=check_id):
                await get_hub()
            assert not fresh.first_time("check errors")  # the checks were said, before the backplane
            with pytest.raises(BackplaneUnavailable, match=check_id):
                await get_hub()  # again: refused at once
        await fresh.aclose()
    finally:
        import realtime_app.conf.runtime as module

        module._process[0] = old
