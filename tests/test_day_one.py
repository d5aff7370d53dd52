"""Day one with your own data and your own mistakes: results straight from models are
answered, a result that cannot be answered is refused at once (never silence), and the
mistakes a newcomer makes are named — at registration, by ``check``, at start-up, or in
the refusal itself."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import time

import pytest
from channels.testing import WebsocketCommunicator
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

import realtime_app
from realtime_app.exceptions import ConfigurationError
from tests.support.asgi_client import Client, app

pytestmark = pytest.mark.django_db(transaction=True)


async def answers_by_id(client: Client, ids: set[int], timeout: float = 1.0) -> dict[int, list[dict]]:
    """Every answer read until each id in ``ids`` has one (batch arrays flattened)."""
    got: dict[int, list[dict]] = {}
    deadline = time.monotonic() + timeout
    while not ids <= set(got):
        message = await client.recv(max(0.01, deadline - time.monotonic()))
        for item in message if isinstance(message, list) else [message]:
            if "id" in item:
                got.setdefault(item["id"], []).append(item)
    return got


async def test_decimal_datetime_and_uuid_results_are_answered_as_jsonresponse_writes_them(hub):
    async with Client() as c:
        answer = await c.call("test.model_values")
    assert answer["result"] == {
        "price": "19.90",
        "at": "2026-12-01T12:00:00Z",
        "id": "12345678-1234-5678-1234-567812345678",
    }


async def test_publications_take_the_same_encoder(hub):
    import decimal

    realtime_app.event_channel("test:priced")
    async with Client() as c:
        await c.call("subscribe", {"channel": "test:priced"})
        await realtime_app.apublish("test:priced", {"price": decimal.Decimal("0.10")})
        [frame] = await c.frames(1, "test:priced")
    assert frame["data"] == {"price": "0.10"}


@pytest.mark.parametrize(
    ("method", "params"),
    [("test.unencodable", None), ("test.unencodable", {"nan": True}), ("test.unencodable_sync", None)],
)
async def test_a_result_json_cannot_carry_is_answered_at_once_and_logged_once_with_the_method(
    hub, caplog, monkeypatch, method, params
):
    from realtime_app.conf.runtime import runtime

    caplog.set_level(logging.DEBUG, logger="realtime_app")
    runtime().said_again(method, family="unencodable result")  # as in a fresh process
    async with Client() as c:
        for _ in range(3):
            started = time.monotonic()
            answer = await c.call(method, params)
            assert time.monotonic() - started < 1.0
            assert answer["error"]["code"] == -32603
            assert answer["error"]["data"]["reason"] == "result_not_serializable"
        assert (await c.call("ping"))["result"] == "pong"  # the connection keeps answering
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and method in errors[0].getMessage()  # once, not once per call
    assert not any("Exception in callback" in r.getMessage() for r in caplog.records)


async def test_no_request_is_left_unanswered_whatever_its_method_does(hub):
    """The invariant: while the connection is open, every request with an id gets exactly
    one answer — results, errors, unencodable results (inline, in the pool, on a thread,
    merged), in batches and alone, in any order."""
    kinds = [
        ("ping", None),
        ("test.echo", {"x": 1}),
        ("test.crash", None),
        ("test.model_values", None),
        ("test.unencodable", None),
        ("test.unencodable", {"nan": True}),
        ("test.unencodable_sync", None),
        ("test.merge_unencodable", None),
        ("test.merge_unencodable", None),
        ("nope.unknown", None),
        ("subscribe", {"channel": "nope:unknown"}),
    ]
    rng = random.Random(7)
    async with Client() as c:
        next_id = 1
        for round_ in range(6):
            picked = rng.sample(kinds, k=len(kinds))
            requests = []
            for method, params in picked:
                request = {"jsonrpc": "2.0", "method": method, "id": next_id}
                if params is not None:
                    request["params"] = params
                requests.append(request)
                next_id += 1
            ids = {r["id"] for r in requests}
            if round_ % 2:
                await c.send(requests)  # one batch
            else:
                for request in requests:
                    await c.send(request)
            got = await answers_by_id(c, ids, timeout=5.0)
            assert set(got) == ids and all(len(answers) == 1 for answers in got.values()), got
            for request in requests:
                [answer] = got[request["id"]]
                assert ("result" in answer) != ("error" in answer), answer


def test_a_method_registered_twice_names_both_functions():
    @realtime_app.rpc_method("test.twice")
    def first(consumer, params):
        return 1

    def second(consumer, params):
        return 2

    with pytest.raises(ImproperlyConfigured) as raised:
        realtime_app.rpc_method("test.twice")(second)
    message = str(raised.value)
    assert "'test.twice'" in message and "first" in message and "second" in message
    realtime_app.rpc_method("test.twice")(first)  # the same function again (a module re-imported): fine


def test_a_bare_rpc_method_decorator_shows_the_right_spelling():
    with pytest.raises(TypeError) as raised:

        @realtime_app.rpc_method
        def consume(consumer, params):
            return None

    assert "@realtime_app.rpc_method('consume')" in str(raised.value)


def test_a_ticker_default_given_as_a_string_says_what_it_wants():
    with pytest.raises(ConfigurationError) as raised:

        @realtime_app.ticker("test:stringly", default="1000")
        def tick(channel):
            return 1

    assert "default must be an int of milliseconds" in str(raised.value) and "'1000'" in str(raised.value)


def test_policies_given_as_a_dict_say_a_list_is_expected():
    with override_settings(REALTIME_APP={"POLICIES": {"pattern": "atelier:", "authenticated": True}}):
        [error] = [m for m in run_checks() if m.id == "realtime_app.E010"]
    assert "expected a list of rules" in error.msg and "got a dict" in error.msg


def test_a_misspelled_settings_name_is_named_by_check():
    with override_settings(REALTIME_APPS={"POLICIES": []}):
        from django.conf import settings

        del settings.REALTIME_APP
        warnings = [m for m in run_checks() if m.id == "realtime_app.W040"]
    assert [w.obj for w in warnings] == ["REALTIME_APPS"]
    assert [m for m in run_checks() if m.id == "realtime_app.W040"] == []  # REALTIME_APP set: nothing to say


def test_an_asgi_application_without_auth_middleware_is_named_by_check():
    assert [m for m in run_checks() if m.id == "realtime_app.W041"] == []  # the tests' application has it
    with override_settings(ASGI_APPLICATION="tests.testapp.noauth_asgi.application"):
        [warning] = [m for m in run_checks() if m.id == "realtime_app.W041"]
    assert "AuthMiddlewareStack" in warning.hint and "RealtimeConsumer" in warning.msg


async def test_a_refusal_on_a_connection_without_a_user_says_why(hub):
    comm = WebsocketCommunicator(app, "/realtime/")
    comm.scope["client"] = ("10.9.9.9", 40000)  # and no "user": no auth middleware ran
    connected, _ = await comm.connect()
    assert connected
    try:
        await comm.send_json_to(
            {"jsonrpc": "2.0", "method": "subscribe", "params": {"channel": "atelier:load"}, "id": 1}
        )
        answer = await comm.receive_json_from(3)
    finally:
        await comm.disconnect()
    assert answer["error"]["data"]["reason"] == "forbidden_channel"
    assert "no user" in answer["error"]["data"]["hint"] and "AuthMiddlewareStack" in answer["error"]["data"]["hint"]
    async with Client() as anonymous:  # an anonymous user (the middleware ran): refused, no hint
        refused = (await anonymous.call("subscribe", {"channel": "atelier:load"}))["error"]["data"]
    assert refused["reason"] == "forbidden_channel" and "hint" not in refused


def test_routing_the_endpoint_of_an_app_that_is_not_installed_fails_at_start_up():
    code = (
        "import django; from django.conf import settings; "
        "settings.configure(INSTALLED_APPS=['django.contrib.auth', 'django.contrib.contenttypes']); "
        "django.setup(); import realtime_app.routing"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and "INSTALLED_APPS" in result.stderr


def test_sync_publish_from_async_code_names_apublish():
    """Found: ``publish()`` inside async code raised asgiref's generic error, with no word
    of ``apublish``."""
    import asyncio

    async def in_a_view() -> None:
        realtime_app.publish("demo:events", {"n": 1})

    with pytest.raises(RuntimeError, match=r"await realtime_app\.apublish"):
        asyncio.run(in_a_view())


async def test_an_applications_own_error_is_its_answer_not_a_bad_request(hub, caplog):
    """Found: an application's ``RPCError`` (the demo's out of stock) was logged as "bad
    request … more are counted until it closes"; a library code still is one."""
    caplog.set_level(logging.DEBUG, "realtime_app.consumers")
    async with Client() as client:
        answer = await client.call("inventory.consume", {"item": "ammo", "shots": 250})
        for _ in range(50):
            answer = await client.call("inventory.consume", {"item": "ammo", "shots": 250})
            if "error" in answer and answer["error"]["code"] == -32010:
                break
        assert answer["error"]["data"]["reason"] == "out_of_stock", answer
        bad = await client.call("subscribe", {"channel": 7})
        assert bad["error"]["code"] == -32602
    lines = [r.getMessage() for r in caplog.records if "bad request" in r.getMessage()]
    assert lines and all("out_of_stock" not in line for line in lines), lines
    assert any("out_of_stock" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_a_json_encoder_that_is_not_one_is_e009(settings):
    from realtime_app.checks.configuration import check_settings

    for value in ("tests.testapp.encoders.Missing", "json.JSONDecoder", 42):
        settings.REALTIME_APP = {"JSON_ENCODER": value}
        assert [m.id for m in check_settings()] == ["realtime_app.E009"], value
    settings.REALTIME_APP = {"JSON_ENCODER": "tests.testapp.encoders.SetEncoder"}
    assert check_settings() == []


async def test_a_projects_own_encoder_writes_results_and_publications(hub, settings):
    """``JSON_ENCODER`` end to end: the set a method returns is answered, and published,
    as the project's encoder writes it (the default refuses it: result_not_serializable)."""
    settings.REALTIME_APP = {**settings.REALTIME_APP, "JSON_ENCODER": "tests.testapp.encoders.SetEncoder"}
    realtime_app.event_channel("test:sets")
    async with Client() as c:
        assert (await c.call("test.unencodable_sync"))["result"] == {"set": [1, 2]}
        await c.call("subscribe", {"channel": "test:sets"})
        await realtime_app.apublish("test:sets", {"tags": {"b", "a"}})
        [frame] = await c.frames(1, "test:sets")
    assert frame["data"] == {"tags": ["a", "b"]}
