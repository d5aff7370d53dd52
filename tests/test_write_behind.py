"""The write-behind store in one process, on the test database: accepted vs durable,
batches, versions, retries, isolation of a bad object, counters of two stores."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError, connection, connections

from project.demo.models import InventoryItem
from realtime_app.persistence.write_behind import WriteBehindStore, WriteRefused

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


@pytest.fixture
async def users(django_user_model):
    create = sync_to_async(django_user_model.objects.create_user)
    return [(await create(f"wb{i}", password="p")).pk for i in range(3)]


_made: list[WriteBehindStore[InventoryItem]] = []


def test_the_database_is_the_one_asked_for():
    """These tests run on SQLite here and on PostgreSQL too
    (tests/test_write_behind_live.py runs this module with ``DATABASE_URL`` on it)."""
    assert connection.vendor == os.environ.get("REALTIME_TEST_DB_VENDOR", "sqlite")


@pytest.fixture(autouse=True)
async def close_stores():
    """The test database goes away with the test: its stores must not flush at exit, and
    the connection of the thread that ran their SQL is closed (PostgreSQL will not drop a
    database that a session still uses)."""
    yield
    while _made:
        _made.pop().close()
    await sync_to_async(connections.close_all)()


def make_store(delay_s: float = 0.2, name: str = "test.inventory") -> WriteBehindStore[InventoryItem]:
    store = WriteBehindStore(
        InventoryItem,
        key=("user_id", "item"),
        fields=("shots",),
        counters=("shots",),
        defaults=lambda key: {"shots": 100},
        delay_s=delay_s,
        name=name,
    )
    _made.append(store)
    return store


@sync_to_async
def rows() -> dict[tuple[int, str], int]:
    return {(r.user_id, r.item): r.shots for r in InventoryItem.objects.all()}


class Statements:
    """Counts the SQL statements of the flush thread (Django runs sync code in one thread)."""

    def __init__(self, fail: Any = None) -> None:
        self.count = 0
        self.sql: list[str] = []
        self.fail = fail  # fail(sql) -> an exception to raise, or None
        self.hold: threading.Event | None = None
        self.hold_on = "UPDATE"  # the statement that waits for ``hold``
        self.holding = threading.Event()
        self._stack = contextlib.ExitStack()

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if self.hold is not None and sql.lstrip().upper().startswith(self.hold_on):
            self.holding.set()
            self.hold.wait(10)
        if self.fail is not None:
            exc = self.fail(sql)
            if exc is not None:
                raise exc
        self.count += 1
        self.sql.append(sql[:60])
        return execute(sql, params, many, context)

    async def __aenter__(self) -> Statements:
        await sync_to_async(lambda: self._stack.enter_context(connection.execute_wrapper(self)))()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await sync_to_async(self._stack.close)()


@contextlib.asynccontextmanager
async def flush_held(store: WriteBehindStore[InventoryItem]) -> Any:
    """A full flush started and held at its UPDATE (in its thread) for the block's length;
    yields the flush's task, released when the block ends."""
    async with Statements() as statements:
        statements.hold = threading.Event()
        flushing = asyncio.get_running_loop().create_task(store.flush(everything=True))
        await asyncio.to_thread(statements.holding.wait, 10)
        try:
            yield flushing
        finally:
            statements.hold.set()


async def test_a_mutation_is_accepted_at_once_and_durable_after_the_delay(users):
    store = make_store(delay_s=0.3)
    accepted = await store.add((users[0], "ammo"), "shots", -5)
    assert accepted.state == {"shots": 95}  # accepted: the new state, at once
    assert await rows() == {}  # not durable yet
    assert store.probe()["dirty"] == 1
    await accepted.durable(timeout=10)
    assert await rows() == {(users[0], "ammo"): 95}
    probe = store.probe()
    assert probe["dirty"] == 0 and probe["flushed_rows"] == 1 and probe["last_flush"]["rows"] == 1


async def test_thousands_of_mutations_become_a_few_batched_statements(users):
    store = make_store(delay_s=60)
    keys = [(users[i % 3], f"item{i}") for i in range(120)]
    for _ in range(10):
        for key in keys:
            await store.add(key, "shots", -1)
    async with Statements() as statements:
        written = await store.flush(everything=True)
    assert written == 120 and await rows() == {key: 90 for key in keys}
    # 3 batches of 50 / 50 / 20, each in a transaction (SQLite's BEGIN counts): its token, the
    # rows there are (locked), the missing rows inserted in a savepoint (3), one counter update,
    # a read-back — 1,200 mutations, 24 statements
    assert statements.count <= 3 * 8 + 1, statements.sql  # (+1: the sweep of old tokens, hourly)


async def test_a_mutation_during_the_flush_keeps_the_object_dirty_and_is_written_next(users):
    store = make_store(delay_s=60)
    key = (users[0], "ammo")
    await store.add(key, "shots", -10)
    await store.flush(everything=True)  # the row exists: the next flush updates it
    await store.add(key, "shots", -1)
    async with flush_held(store) as flushing:
        late = await store.add(key, "shots", -2)  # while the flush writes -1
    await flushing
    assert await rows() == {key: 89}  # the flush wrote the state it took...
    assert store.probe()["dirty"] == 1 and late.state == {"shots": 87}  # ...and the newer one waits
    await store.flush(everything=True)
    assert await rows() == {key: 87}
    await late.durable(timeout=5)


async def test_transient_errors_are_retried_and_a_failing_database_loses_nothing(users):
    store = make_store(delay_s=60)
    key = (users[0], "ammo")
    await store.add(key, "shots", -3)
    attempts = {"n": 0}

    def twice(sql: str) -> Exception | None:
        attempts["n"] += 1
        return OperationalError("server closed the connection unexpectedly") if attempts["n"] <= 2 else None

    async with Statements(fail=twice):
        assert await store.flush(everything=True) == 1
    assert await rows() == {key: 97} and store.probe()["retries"] == 2
    await store.add(key, "shots", -4)
    async with Statements(fail=lambda sql: OperationalError("could not connect to server")):
        assert await store.flush(everything=True) == 0  # 1 + 3 retries, all failed: kept
    probe = store.probe()
    assert probe["dirty"] == 1 and probe["consecutive_failures"] == 1 and await rows() == {key: 97}
    assert store.entries[key].not_before > 0  # the next attempt is backed off
    assert await store.flush(everything=True) == 1  # the database is back
    assert await rows() == {key: 93} and store.probe()["consecutive_failures"] == 0


async def test_an_object_the_database_refuses_is_isolated_reported_once_and_never_retried(users, caplog):
    """A refusal that is not an outage (here a check constraint) is not retried forever nor
    journaled: the others are written, the object is logged once at ERROR, counted, its
    waiter told, and it is read again from the database."""
    store = make_store(delay_s=60)
    good = [(users[0], f"good{i}") for i in range(7)]
    bad = (users[1], "bad")
    for key in good:
        await store.add(key, "shots", -1)
    refused = await store.add(bad, "shots", -150)  # 100 - 150 < 0: the database's check refuses it
    assert await store.flush(everything=True) == 7
    assert await rows() == {key: 99 for key in good}
    probe = store.probe()
    assert probe["dirty"] == 0 and probe["refused"] == 1 and "IntegrityError" in probe["failing"][repr(bad)]
    with pytest.raises(WriteRefused) as raised:
        await refused.durable(timeout=1)
    assert raised.value.key == bad and "IntegrityError" in raised.value.reason
    assert await store.flush(everything=True) == 0  # not tried again
    assert store.journal_unsaved() == 0  # nothing an outage left: nothing journaled
    errors = [r for r in caplog.records if r.levelname == "ERROR" and repr(bad) in r.getMessage()]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert (await store.get(bad)) == {"shots": 100}  # what the database holds: no row, the defaults
    again = await store.add(bad, "shots", -1)
    assert again.state == {"shots": 99}
    await store.flush(everything=True)
    assert (await rows())[bad] == 99


async def test_deletes_are_batched_and_a_deleted_object_can_come_back(users):
    store = make_store(delay_s=60)
    keys = [(users[0], f"d{i}") for i in range(250)]
    for key in keys:
        await store.add(key, "shots", -1)
    await store.flush(everything=True)
    for key in keys[:210]:
        await store.delete(key)
    async with Statements() as statements:
        await store.flush(everything=True)
    # 200 + 10: two batches, each BEGIN, its token, one DELETE
    assert len(await rows()) == 40 and statements.count <= 2 * 3 + 1, statements.sql
    again = await store.add(keys[0], "shots", -1)
    assert again.state == {"shots": 99}  # recreated from the defaults
    await store.flush(everything=True)
    assert (await rows())[keys[0]] == 99


async def test_two_stores_on_one_counter_both_land(users):
    """Two processes of one user, in miniature: deltas commute, the sum is exact."""
    a, b = make_store(delay_s=60, name="a"), make_store(delay_s=60, name="b")
    key = (users[2], "ammo")
    for _ in range(30):
        await a.add(key, "shots", -1)
        await b.add(key, "shots", -2)
    assert (await a.get(key))["shots"] == 70 and (await b.get(key))["shots"] == 40  # each its own view
    await a.flush(everything=True)
    await b.flush(everything=True)
    assert await rows() == {key: 100 - 30 - 60}
    await a.add(key, "shots", -1)
    await a.flush(everything=True)
    assert (await a.get(key))["shots"] == 9  # a flush reads the counter back: b's shots included


# -- review findings: each with the test that would have caught it -----------------------


async def test_a_delete_then_a_new_object_before_the_flush_replaces_the_row(users):
    store = make_store(delay_s=60)
    key = (users[0], "ammo")
    await store.add(key, "shots", -30)
    await store.flush(everything=True)
    assert await rows() == {key: 70}
    await store.delete(key)
    again = await store.add(key, "shots", -5)  # a new object: the defaults, then -5
    assert again.state == {"shots": 95}
    await store.flush(everything=True)
    assert await rows() == {key: 95} and (await store.get(key)) == {"shots": 95}


async def test_a_delete_during_a_flush_leaves_no_phantom_delta(users):
    store = make_store(delay_s=60)
    key = (users[0], "ammo")
    await store.add(key, "shots", -10)
    async with flush_held(store) as flushing:
        await store.delete(key)  # while the flush writes -10
    await flushing
    assert store.entries[key].deltas == {}
    await store.flush(everything=True)
    assert await rows() == {}  # the delete won; nothing came back
    again = await store.add(key, "shots", -1)
    await store.flush(everything=True)
    assert again.state == {"shots": 99} and await rows() == {key: 99}


async def test_a_cancelled_first_reader_does_not_cancel_the_others(users):
    store = make_store(delay_s=60)
    key = (users[0], "ammo")
    async with Statements() as statements:
        statements.hold = threading.Event()
        statements.hold_on = "SELECT"
        first = asyncio.get_running_loop().create_task(store.get(key))
        await asyncio.to_thread(statements.holding.wait, 10)
        second = asyncio.get_running_loop().create_task(store.get(key))
        await asyncio.sleep(0.05)
        first.cancel()  # its connection closed while the row was being read
        statements.hold.set()
        assert await second == {"shots": 100}
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_a_commit_whose_answer_is_lost_is_not_applied_twice(users):
    store = make_store(delay_s=60)
    key = (users[0], "ammo")
    await store.add(key, "shots", -10)
    await store.flush(everything=True)
    await store.add(key, "shots", -7)
    real = store.table.write_batch
    lost = {"n": 0}

    def committed_then_lost(batch: Any, token: str, *rest: Any) -> Any:
        result = real(batch, token, *rest)
        if lost["n"] == 0:  # the COMMIT went through; its answer did not
            lost["n"] += 1
            raise OperationalError("server closed the connection unexpectedly")
        return result

    store.table.write_batch = committed_then_lost  # type: ignore[method-assign]
    await store.flush(everything=True)  # the retry finds the batch's token: no second -7
    assert await rows() == {key: 83} and store.probe()["dirty"] == 0


async def test_a_flush_cancelled_mid_write_is_settled_not_rewritten(users):
    store = make_store(delay_s=60)
    key = (users[0], "ammo")
    await store.add(key, "shots", -4)
    async with flush_held(store) as flushing:
        flushing.cancel()  # the loop goes away; the write in its thread goes on and commits
    with pytest.raises(asyncio.CancelledError):
        await flushing
    assert store.probe()["in_doubt"] == 1
    deadline = asyncio.get_running_loop().time() + 10
    while await rows() != {key: 96}:  # the orphaned write commits in its thread
        assert asyncio.get_running_loop().time() < deadline, "the cancelled write never committed"
        await asyncio.sleep(0.02)
    await store.flush(everything=True)  # the batch again, under its token: settled
    assert await rows() == {key: 96} and store.probe()["dirty"] == 0 and store.probe()["in_doubt"] == 0


async def test_a_row_another_process_deleted_is_recreated_with_the_shots_accepted_here(users):
    store = make_store(delay_s=60)
    key = (users[0], "ammo")
    await store.add(key, "shots", -10)
    await store.flush(everything=True)
    await sync_to_async(InventoryItem.objects.all().delete)()  # the admin, a cascade, another process
    await store.add(key, "shots", -1)
    await store.flush(everything=True)
    assert await rows() == {key: 89}  # not silently lost: the base this process knew, minus its shot


async def test_plain_fields_are_written_only_for_the_objects_that_changed_them():
    from tests.testapp.models import Profile

    await sync_to_async(Profile.objects.create)(handle="x", nickname="old", color="red")
    await sync_to_async(Profile.objects.create)(handle="y", nickname="why", color="blue")
    store = WriteBehindStore(Profile, key=("handle",), fields=("nickname", "color", "score"), counters=("score",))
    _made.append(store)
    await store.get("x")
    await store.get("y")
    # another process changes x's color meanwhile; this one changes x's nickname and y's color
    await sync_to_async(Profile.objects.filter(handle="x").update)(color="green")
    await store.mutate("x", {"nickname": "new"})
    await store.mutate("y", {"color": "black"})
    await store.add("x", "score", 3)
    await store.flush(everything=True)
    got = await sync_to_async(lambda: {p.handle: (p.nickname, p.color, p.score) for p in Profile.objects.all()})()
    assert got == {"x": ("new", "green", 3), "y": ("why", "black", 0)}  # x's stale color not written back


async def test_what_cannot_be_written_at_the_end_is_journaled_and_the_next_process_writes_it_once(
    users, tmp_path, settings
):
    """A stop during a database outage: the final flush fails, so the store journals what it
    accepted — the batch in doubt (its commit may have happened) under its own token, the
    rest under new ones — and a store of the same name in the next process writes it, the
    committed batch not twice."""
    settings.REALTIME_APP = {**settings.REALTIME_APP, "WRITE_BEHIND_JOURNAL_DIR": str(tmp_path)}
    store = make_store(delay_s=60, name="test.journaled")
    a, b = (users[0], "ammo"), (users[1], "ammo")
    await store.add(a, "shots", -10)
    await store.flush(everything=True)
    await store.add(a, "shots", -7)  # its batch commits, the answer is lost, then the database goes
    real = store.table.write_batch
    committed = {"n": 0}

    def committed_then_gone(batch: Any, token: str, *rest: Any) -> Any:
        if committed["n"] == 0:
            committed["n"] += 1
            real(batch, token, *rest)
        raise OperationalError("could not connect to server")

    store.table.write_batch = committed_then_gone  # type: ignore[method-assign]
    await store.flush(everything=True)
    await store.add(a, "shots", -1)  # after the batch in doubt
    await store.add(b, "shots", -3)  # never written at all
    assert await rows() == {a: 83}  # the -7 did commit
    assert store.journal_unsaved() == 3  # a's batch in doubt, a's -1, b's -3
    [file] = list(tmp_path.glob("*.json"))
    assert store.probe()["dirty"] == 0  # handed over: never journaled twice
    assert store.journal_unsaved() == 0 and len(list(tmp_path.glob("*.json"))) == 1
    store.close()

    later = make_store(delay_s=60, name="test.journaled")  # the next process
    later.start()
    assert later.probe()["replayed"] == 3 and not file.exists()  # taken over (renamed)
    await later.flush(everything=True)
    assert await rows() == {a: 82, b: 97}  # -7 once (its token), then -1 and -3
    assert not list(tmp_path.iterdir())  # written: the journal is gone
    assert (await later.get(a)) == {"shots": 82}


async def test_a_journal_that_cannot_be_written_says_how_much_is_lost(users, tmp_path, settings, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    settings.REALTIME_APP = {**settings.REALTIME_APP, "WRITE_BEHIND_JOURNAL_DIR": str(blocked)}
    store = make_store(delay_s=60, name="test.unjournaled")
    await store.add((users[0], "ammo"), "shots", -1)
    assert store.journal_unsaved() == 0
    [record] = [r for r in caplog.records if "LOST" in r.getMessage()]
    assert record.levelname == "ERROR" and "1 accepted object(s) LOST" in record.getMessage()


async def test_the_backoff_grows_while_a_batch_in_doubt_keeps_failing(users):
    """Found: after a failed retry of a batch in doubt, the flush wrote an empty batch,
    which reset the failure count: retries every 0.5-1 s instead of backing off to 30 s."""
    store = make_store(delay_s=60)
    key = (users[0], "ammo")
    await store.add(key, "shots", -1)
    async with Statements(fail=lambda sql: OperationalError("could not connect to server")):
        await store.flush(everything=True)  # fails: the batch is in doubt now
        assert store.probe()["consecutive_failures"] == 1 and store.probe()["in_doubt"] == 1
        for n in range(2, 6):
            store.entries[key].not_before = 0.0  # due again now
            await store.flush()  # its retry fails again
            assert store.probe()["consecutive_failures"] == n
    backoff = store.entries[key].not_before - time.monotonic()
    assert backoff >= 0.5 * 2**5 * 0.5 - 1  # 0.5 s x 2^5, jittered down to half at most


async def test_saved_objects_past_max_objects_are_forgotten_unsaved_ones_kept(users):
    store = make_store(delay_s=60)
    store.max_objects = 10
    for i in range(15):
        await store.get((users[0], f"item{i}"))
    assert store.probe()["objects"] == 10 and store.probe()["evicted"] == 5
    dirty = [(users[1], f"dirty{i}") for i in range(12)]
    for key in dirty:
        await store.add(key, "shots", -1)
    assert all(store.unsaved(key) for key in dirty)  # over the bound, but nothing unsaved goes
    await store.flush(everything=True)
    await store.get((users[2], "one more"))
    assert store.probe()["objects"] <= 10
    assert await rows() == {key: 99 for key in dirty}
