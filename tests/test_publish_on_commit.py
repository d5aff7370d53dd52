"""A publication made inside a transaction goes out when the outermost transaction
commits, and never when it rolls back, a savepoint's rollback included; ``now=True``
sends it whatever the transaction does; bad data is refused at the call, not after the
commit (realtime_app.hub.publishing).

Found: the demo's ``demo.post`` with ``"fail": true`` delivered a message the database
never kept; a bid that rolled back reached every client."""

from __future__ import annotations

import contextlib

import pytest
from asgiref.sync import sync_to_async
from django.db import transaction

import realtime_app
from realtime_app.exceptions import PublicationError
from tests.support.asgi_client import Client

pytestmark = pytest.mark.django_db(transaction=True)


def _publish_in_transactions() -> list[object]:
    returned = []
    with transaction.atomic():
        returned.append(realtime_app.publish("test:big-history", {"n": "rolled back"}))
        transaction.set_rollback(True)
    with transaction.atomic():
        with contextlib.suppress(ValueError), transaction.atomic():  # a savepoint that rolls back
            realtime_app.publish("test:big-history", {"n": "in a rolled-back savepoint"})
            raise ValueError
        with transaction.atomic():  # a savepoint kept: sent with the outermost commit
            realtime_app.publish("test:big-history", {"n": "kept"})
    with pytest.raises(PublicationError), transaction.atomic():
        realtime_app.publish("test:big-history", {"n": object()})  # refused now, not after the commit
    with transaction.atomic():
        returned.append(realtime_app.publish("test:big-history", {"n": "progress"}, now=True))
        transaction.set_rollback(True)
    returned.append(realtime_app.publish("test:big-history", {"n": "outside"}))
    return returned


async def test_publications_inside_a_transaction_go_out_on_commit_never_on_rollback(hub):
    async with Client() as c:
        first = (await c.call("subscribe", {"channel": "test:big-history"}))["result"]
        returned = await sync_to_async(_publish_in_transactions)()
        frames = await c.frames(3)
    # what rolled back came first: had it been sent, it would be the first frames
    assert [f["data"]["n"] for f in frames] == ["kept", "progress", "outside"]
    assert [f["seq"] for f in frames] == [first["seq"] + 1, first["seq"] + 2, first["seq"] + 3]
    assert returned == [None, first["seq"] + 2, first["seq"] + 3]  # deferred: no seq yet


def _publish_with_two_databases() -> None:
    with transaction.atomic(using="other"):
        realtime_app.publish("test:big-history", {"n": "other, rolled back"}, using="other")
        transaction.set_rollback(True, using="other")
    with transaction.atomic(using="default"):  # no transaction on "other": sent at once
        realtime_app.publish("test:big-history", {"n": "other, at once"}, using="other")
        transaction.set_rollback(True, using="default")
    with transaction.atomic(using="other"):
        realtime_app.publish("test:big-history", {"n": "other, committed"}, using="other")
    with transaction.atomic(using="other"):  # none on the default database: sent at once
        realtime_app.publish("test:big-history", {"n": "default, at once"})
        transaction.set_rollback(True, using="other")


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
async def test_a_publication_follows_the_transaction_of_its_own_database(hub):
    """``publish(using=)`` waits for that database's transaction, not the default one's.
    Found: only the default database was tested; dropping ``using`` passed."""
    async with Client() as c:
        await c.call("subscribe", {"channel": "test:big-history"})
        await sync_to_async(_publish_with_two_databases)()
        frames = await c.frames(3)
        assert [f["data"]["n"] for f in frames] == ["other, at once", "other, committed", "default, at once"]
        assert await c.comm.receive_nothing(0.2)


async def test_apublish_outside_a_transaction_goes_at_once(hub):
    async with Client() as c:
        first = (await c.call("subscribe", {"channel": "test:big-history"}))["result"]
        assert await realtime_app.apublish("test:big-history", {"n": 1}) == first["seq"] + 1
        assert (await c.frames(1))[0]["data"] == {"n": 1}
