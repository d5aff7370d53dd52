"""realtime_app.testing, as an application's tests use it (docs/testing.md): the fixtures
the package registers with pytest, a client per user, methods answered or raised, a
channel's frames read, a ticker advanced without sleeping, a token connection."""

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async

import realtime_app
from realtime_app.exceptions import RPCError
from realtime_app.testing import RealtimeTestClient

pytestmark = pytest.mark.django_db(transaction=True)


async def test_a_method_answers_and_a_bad_call_raises(realtime_client):
    client = await realtime_client()
    assert await client.call("demo.echo", {"text": "hi"}) == {"text": "hi"}
    with pytest.raises(RPCError) as refused:
        await client.call("demo.echo", {"text": 3})
    assert refused.value.reason == "invalid_text"


async def test_a_channel_delivers_what_the_application_publishes(realtime_client):
    client = await realtime_client()
    await client.subscribe("test:events")
    seq = await realtime_app.apublish("test:events", {"n": 1})
    message = await client.message("test:events")
    assert (message["data"], message["seq"]) == ({"n": 1}, seq)  # message(): the params
    await client.nothing()
    await realtime_app.apublish("test:events", {"n": 2})
    whole = await client.notification()  # notification(): the whole of it
    assert whole["method"] == "message" and whole["params"]["data"] == {"n": 2}


async def test_a_ticker_advances_without_sleeping_and_rules_hold(realtime_client, django_user_model):
    staff = await sync_to_async(django_user_model.objects.create_user)("sam", password="p", is_staff=True)
    anonymous, signed_in = await realtime_client(), await realtime_client(staff)
    with pytest.raises(RPCError) as refused:
        await anonymous.subscribe("test:staff")
    assert refused.value.reason == "forbidden_channel"
    await signed_in.subscribe("test:crowd:5000")  # a 5 s cadence: the test does not wait for it
    seq = await signed_in.tick("test:crowd:5000")
    message = await signed_in.message("test:crowd:5000", timeout=1)
    assert (message["data"], message["seq"]) == ({"interval_ms": 5000}, seq)


async def test_a_token_client_is_its_user(realtime_hub, django_user_model):
    from realtime_app.endpoint.tokens import issue

    ann = await sync_to_async(django_user_model.objects.create_user)("ann", password="p")
    token, _ = issue(ann, 60)
    async with RealtimeTestClient(token=token) as client:
        posted = await client.call("auth", {"token": token})
        assert posted["user"] == "ann"
    with pytest.raises(AssertionError, match="4002"):
        async with RealtimeTestClient(token=token + "x"):
            pass


PROJECT_TEST = """
import pytest
from asgiref.sync import sync_to_async

pytestmark = pytest.mark.django_db(transaction=True)


async def test_a_member_channel(realtime_client, django_user_model):
    ann = await sync_to_async(django_user_model.objects.create_user)("ann", password="p")
    client = await realtime_client(ann)
    await client.subscribe(f"test:member:{ann.pk}")  # its exists hook asks the database
    with pytest.raises(Exception):
        await client.subscribe("test:staff")  # a rule read for a user (asgiref's worker thread)
"""


def test_a_projects_tests_on_postgresql_leave_no_connection_behind(tmp_path):
    """A project's tests with realtime_app.testing, on PostgreSQL, in a pytest of their own.
    Found: under Channels' test communicator (which skips closing old connections) each pool
    thread that ran an ``exists`` hook or a rule kept its connection, so pytest-django could
    not drop the test database ("being accessed by other users") and waited 5 s for it."""
    import os
    import secrets
    import subprocess
    import sys

    from tests.support.postgres import server_url, with_database
    from tests.support.servers import ROOT

    (tmp_path / "test_project.py").write_text(PROJECT_TEST)
    name = f"rt_testing_{secrets.token_hex(4)}"
    env = {**os.environ, "DATABASE_URL": with_database(server_url(), name), "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_project.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "1 passed" in output, output[-3000:]
    assert "being accessed by other users" not in output, output[-3000:]
