"""The token and publish views' answers to every kind of request, in process (the views
called with Django's request objects; the live server is tests/test_tokens_live.py): the
method, who asks, each shape of a bad body (400 and what was expected), the body bounds
(413, declared or not), and what a good request gets.

Found by mutation testing (scripts/mutants): the views' input checks could be loosened
or their status codes changed with every test green."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import AnonymousUser
from django.test import RequestFactory, override_settings

from realtime_app.conf import get_config
from realtime_app.endpoint.tokens import verify
from realtime_app.views import PUBLISH_BATCH, issue_token, publish_api
from tests.support.asgi_client import Client

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "in-process-key"
factory = RequestFactory()


def as_user(request: Any, user: Any) -> Any:
    async def auser() -> Any:
        return user

    request.auser = auser
    return request


async def token_answer(user: Any, body: bytes | None = b"", method: str = "post") -> tuple[int, dict[str, Any]]:
    make = getattr(factory, method)
    request = (
        make("/realtime/api/token", data=body, content_type="application/json")
        if body is not None
        else make("/realtime/api/token")
    )
    response = await issue_token(as_user(request, user))
    return response.status_code, (json.loads(response.content) if response.content.startswith(b"{") else {})


@pytest.fixture
async def ann(django_user_model):
    return await sync_to_async(django_user_model.objects.create_user)("ann-http", password="p")


async def test_the_token_view_answers_post_only_to_a_signed_in_user(ann):
    for method in ("get", "put", "delete", "patch"):  # before and after "POST" in any order of names
        assert (await token_answer(ann, None, method))[0] == 405
    assert (await token_answer(AnonymousUser()))[0] == 401
    status, body = await token_answer(ann)  # no body: the default lifetime
    assert status == 200 and verify(body["token"]).user == str(ann.pk)
    assert body["expires_at"] - time.time() > get_config()["TOKEN_TTL_S"] - 60


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"ttl": true}', 'expected {"ttl": seconds} or no body'),
        (b'{"ttl": "30"}', 'expected {"ttl": seconds} or no body'),
        (b'{"ttl": 1.5}', 'expected {"ttl": seconds} or no body'),
        (b"[30]", 'expected {"ttl": seconds} or no body'),  # no .get: AttributeError
        (b"{not json", 'expected {"ttl": seconds} or no body'),  # ValueError
        (b'{"ttl": 0}', "TOKEN_MAX_TTL_S"),  # issue() refuses it: ValueError, said as it is
        (b'{"ttl": 999999999}', "TOKEN_MAX_TTL_S"),
    ],
)
async def test_a_bad_token_request_is_400_saying_what_was_expected(ann, body, expected):
    status, answer = await token_answer(ann, body)
    assert status == 400 and expected in answer["error"] and "token" not in answer


async def test_a_token_lives_what_was_asked_and_is_never_cached(ann):
    request = as_user(factory.post("/realtime/api/token", data=b'{"ttl": 30}', content_type="application/json"), ann)
    response = await issue_token(request)
    body = json.loads(response.content)
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    assert verify(body["token"]).expires_at == body["expires_at"] <= time.time() + 30
    assert (await token_answer(ann, b'{"ttl": null}'))[0] == 200  # null: the default


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


async def publish(
    body: Any = None, *, raw: bytes | None = None, key: str | None = KEY, method: str = "post", **meta: Any
) -> tuple[int, dict[str, Any], Any]:
    headers = {"HTTP_AUTHORIZATION": f"Bearer {key}"} if key is not None else {}
    data = raw if raw is not None else json.dumps(body).encode()
    if method == "get":
        request = factory.get("/realtime/api/publish", **headers)
    else:
        make = getattr(factory, method)
        request = make("/realtime/api/publish", data=data, content_type="application/json", **headers)
    request.META.update(meta)
    response = await publish_api(request)
    return response.status_code, dict(response.items()), json.loads(response.content) if response.content else None


@pytest.fixture
async def api(hub):
    with override_settings(REALTIME_APP={**get_config(), "PUBLISH_API_KEYS": ["other-key", KEY]}):
        yield hub


async def test_the_publish_view_answers_post_only_with_a_key(api):
    for method in ("get", "put", "delete", "patch"):
        assert (await publish({"channel": "test:events", "data": 1}, method=method))[0] == 405
    status, headers, body = await publish({"channel": "test:events", "data": 1}, key=None)
    assert status == 401 and "WWW-Authenticate" in headers and "PUBLISH_API_KEYS" in body["error"]
    assert (await publish({"channel": "test:events", "data": 1}, key="wrong"))[0] == 401
    async with Client() as c:
        first = (await c.call("subscribe", {"channel": "test:big-history"}))["result"]
        status, _, body = await publish({"channel": "test:big-history", "data": {"n": 1}})
        assert (status, body) == (202, {"channel": "test:big-history", "seq": first["seq"] + 1})
        assert [f["data"] for f in await c.frames(1)] == [{"n": 1}]


@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",  # ValueError
        b"null",  # TypeError: no "in"
        b"[1]",  # a list: TypeError
        b'"text"',
        b'{"channel": "test:events"}',  # KeyError: no data
        b'{"data": 1}',
        b'{"channel": 7, "data": 1}',  # not a name
        b'{"publications": []}',  # none
        b'{"publications": "test:events"}',  # not a list
        b'{"publications": [{"channel": "test:events"}]}',
        json.dumps({"publications": [{"channel": "test:events", "data": 0}] * (PUBLISH_BATCH + 1)}).encode(),
    ],
)
async def test_a_bad_publish_body_is_400_saying_the_shape_expected(api, raw):
    status, _, body = await publish(raw=raw)
    assert status == 400 and "at most 100" in body["error"], body


async def test_a_full_batch_goes_out_whole_with_one_result_each(api):
    items = [{"channel": "test:big-history", "data": i} for i in range(PUBLISH_BATCH)]
    items[1] = {"channel": "test:nowhere", "data": 0}
    async with Client() as c:
        first = (await c.call("subscribe", {"channel": "test:big-history"}))["result"]
        status, _, body = await publish({"publications": items})
        assert status == 202 and len(body["results"]) == PUBLISH_BATCH
        assert body["results"][1] == {"channel": "test:nowhere", "error": "unknown channel"}  # no status inside
        assert body["results"][0] == {"channel": "test:big-history", "seq": first["seq"] + 1}
        assert len(await c.frames(PUBLISH_BATCH - 1)) == PUBLISH_BATCH - 1
    assert (await publish({"channel": "test:nowhere", "data": 0}))[:3:2] == (
        404,
        {
            "channel": "test:nowhere",
            "error": "unknown channel",
        },
    )


@pytest.mark.parametrize("django_bound", [2_500_000, None])
async def test_a_body_over_a_batch_of_publications_is_413_and_one_under_it_goes(api, settings, django_bound):
    """The bound is a batch's worth: ``PUBLISH_BATCH`` × ``MAX_PUBLICATION_BYTES`` (under
    Django's own ``DATA_UPLOAD_MAX_MEMORY_SIZE``, when it sets one)."""
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = django_bound
    settings.REALTIME_APP = {**settings.REALTIME_APP, "MAX_PUBLICATION_BYTES": 1000}
    bound = PUBLISH_BATCH * 1000
    items = [{"channel": "test:events", "data": "x" * 900} for _ in range(PUBLISH_BATCH)]
    raw = json.dumps({"publications": items}).encode()
    assert 90_000 < len(raw) <= bound
    raw += b" " * (bound - len(raw))  # exactly at the bound: taken
    status, _, body = await publish(raw=raw)
    assert status == 202 and len(body["results"]) == PUBLISH_BATCH
    status, _, body = await publish(raw=raw + b" ")  # one byte over
    assert status == 413 and str(bound) in body["error"]


async def test_a_body_over_djangos_bound_is_413_even_undeclared(api, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 100
    status, _, body = await publish({"channel": "test:events", "data": "x" * 200}, CONTENT_LENGTH="")
    assert status == 413 and "DATA_UPLOAD_MAX_MEMORY_SIZE" in body["error"]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"channel": "test:events", "data": ' + b"[" * 1000 + b"]" * 1000 + b"}", "too_deep"),  # json.loads recurses
        (
            json.dumps({"channel": "test:events", "data": _nested(40)}).encode(),
            "too_deep",
        ),  # parsed, over the socket's bound
    ],
)
async def test_a_body_nested_too_deep_is_400_not_a_500(api, raw, reason):
    status, _, body = await publish(raw=raw)
    assert status == 400 and body["reason"] == reason, body


async def test_data_at_the_sockets_depth_bound_goes_out(api):
    from realtime_app.wire.protocol import MAX_DEPTH

    status, _, body = await publish({"channel": "test:events", "data": _nested(MAX_DEPTH - 1)})
    assert status == 202, body
