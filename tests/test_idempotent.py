"""Calls that run once (rpc_method(idempotent=True), realtime_app.hub.once): a key runs
once per identity, its repeats on any connection get the first answer or wait for it;
answers are kept bounded; a failure that is not the call's own frees the key."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

from realtime_app.conf import get_config
from realtime_app.hub.once import OnceBook
from tests.support.asgi_client import Client
from tests.testapp.realtime_channels import once_runs

pytestmark = pytest.mark.django_db(transaction=True)


async def _user(django_user_model, name):
    return await sync_to_async(django_user_model.objects.create_user)(name, password="p")


async def test_one_key_runs_once_for_one_user_on_any_connection(hub, django_user_model):
    alice, bob = await _user(django_user_model, "alice"), await _user(django_user_model, "bob")
    key = secrets.token_hex(8)
    async with Client(alice) as a1, Client(alice) as a2, Client(bob) as b:
        first = await a1.call("test.once", {"idempotency_key": key})
        again = await a2.call("test.once", {"idempotency_key": key})  # another connection, same user
        assert first["result"] == again["result"] == {"run": 1, "pad": ""} and once_runs[key] == 1
        other = await b.call("test.once", {"idempotency_key": key})  # another user's key: its own
        assert other["result"] == {"run": 2, "pad": ""} and once_runs[key] == 2
        plain = [await a1.call("test.once", {}) for _ in range(2)]  # no key: every call runs
        assert [p["result"]["run"] for p in plain] == [1, 2]
    assert hub.gate.once.probe()["repeats"] == 1


async def test_a_repeat_waits_for_the_running_first_call(hub, django_user_model):
    alice = await _user(django_user_model, "alice")
    key = secrets.token_hex(8)
    async with Client(alice) as a1, Client(alice) as a2:
        answers = await asyncio.gather(
            a1.call("test.once", {"idempotency_key": key, "seconds": 0.3}),
            a2.call("test.once", {"idempotency_key": key, "seconds": 0.3}),
        )
    assert answers[0]["result"] == answers[1]["result"] and once_runs[key] == 1
    assert hub.gate.once.probe()["waited"] == 1


async def test_every_answer_of_a_call_that_ran_is_kept_errors_included(hub, django_user_model):
    """An internal error may come after the handler committed: its repeat gets the error,
    it does not run again (found in review: a freed key ran a crashed call twice)."""
    alice = await _user(django_user_model, "alice")
    refused, crashed = secrets.token_hex(8), secrets.token_hex(8)
    async with Client(alice) as a:
        for _ in range(2):
            error = (await a.call("test.once", {"idempotency_key": refused, "refuse": True}))["error"]
            assert error["data"]["reason"] == "refused_by_method"
        assert once_runs[refused] == 1  # its outcome: kept
        for _ in range(2):
            error = (await a.call("test.once", {"idempotency_key": crashed, "crash": True}))["error"]
            assert error["data"]["reason"] == "internal_error"
        assert once_runs[crashed] == 1  # ran once: its answer stays
        bad = (await a.call("test.once", {"idempotency_key": ""}))["error"]
        assert (bad["code"], bad["data"]["reason"]) == (-32602, "invalid_idempotency_key")


async def test_an_answer_over_the_bound_is_not_kept_and_its_repeats_are_told(hub, django_user_model):
    alice = await _user(django_user_model, "alice")
    key = secrets.token_hex(8)
    with override_settings(REALTIME_APP={**get_config(), "IDEMPOTENCY_MAX_ANSWER_BYTES": 1000}):
        async with Client(alice) as a:
            first = await a.call("test.once", {"idempotency_key": key, "pad": 2000})
            assert len(first["result"]["pad"]) == 2000  # the first caller gets its answer
            again = (await a.call("test.once", {"idempotency_key": key, "pad": 2000}))["error"]
    assert again["data"]["reason"] == "answer_not_kept" and once_runs[key] == 1


def test_one_process_book_is_bounded_in_bytes_and_forgets_the_oldest_first():
    now = [0.0]
    book = OnceBook(max_bytes=300, clock=lambda: now[0])
    for i in range(10):
        assert book.claim(f"k{i}", "o", 60_000) == ("run", None)
        book.keep(f"k{i}", "o", "a" * 40, 60_000)
    assert book.bytes <= 300 and book.claim("k9", "p", 1000) == ("answer", "a" * 40)
    assert book.claim("k0", "p", 1000) == ("run", None)  # forgotten: runs again
    assert book.claim("k0", "q", 1000) == ("running", None)
    now[0] += 2  # the claim's lease lapsed (its process died): a retry runs
    assert book.claim("k0", "q", 1000) == ("run", None)
    book.keep("k0", "someone else", "theirs", 1000)  # only a claim's owner answers it
    assert book.claim("k0", "r", 1000) == ("running", None)


async def test_a_keyed_call_runs_to_its_end_when_its_connection_closes(hub, django_user_model):
    """Found in review: the pool cancelled an abandoned async call and its key was freed, so
    the client's retry ran the handler a second time."""
    from tests.support.waiting import eventually

    alice = await _user(django_user_model, "alice")
    key = secrets.token_hex(8)
    async with Client(alice) as a:
        await a.call_nowait("test.once", {"idempotency_key": key, "seconds": 0.3})
        await eventually(lambda: once_runs.get(key) == 1, 5, "the first call running")
    async with Client(alice) as again:  # the connection closed mid-call; the retry
        answer = await again.call("test.once", {"idempotency_key": key, "seconds": 0.3})
    assert answer["result"]["run"] == 1 and once_runs[key] == 1


async def test_the_per_identity_bound_frees_as_answers_expire_and_a_refusal_is_kept_until_its_retry():
    """One process, a fake clock: an identity over IDEMPOTENCY_MAX_BYTES_PER_IDENTITY is
    refused a new key until its oldest answer expires; the refusal answers that key's
    repeats only until its retry_after_ms, then the key runs (nothing ran the first time)."""
    from realtime_app.conf import DEFAULTS
    from realtime_app.conf.typed import Settings
    from realtime_app.hub.once import Once

    now = [1000.0]
    settings = Settings.from_config({**DEFAULTS, "IDEMPOTENCY_TTL_S": 10, "IDEMPOTENCY_MAX_BYTES_PER_IDENTITY": 2500})
    once = Once(settings, lambda: None, clock=lambda: now[0])
    once.local.clock = once.clock
    ran: list[str] = []

    async def big(method: str, params: dict) -> tuple[bool, dict]:
        ran.append(params["k"])
        return True, {"doc": "y" * 1000}

    who = ("address", "192.0.2.1")
    assert [(await once.run(who, k, big, "m", {"k": k}))[0] for k in ("a", "b", "c")] == [True, True, True]
    ok, refused = await once.run(who, "d", big, "m", {"k": "d"})
    assert not ok and refused["data"]["reason"] == "idempotency_full" and ran == ["a", "b", "c"]
    assert 0 < refused["data"]["retry_after_ms"] <= 10_000
    now[0] += 5
    assert (await once.run(who, "d", big, "m", {"k": "d"}))[1] == refused  # kept until its retry time
    now[0] = 1000.0 + 10.001  # the first three expired: room again, and the refusal with them
    assert (await once.run(who, "d", big, "m", {"k": "d"}))[0] is True and ran == ["a", "b", "c", "d"]
    assert once.probe()["refused_full"] == 1 and once.kept_bytes[who] < 2500
