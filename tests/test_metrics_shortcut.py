"""A Prometheus scrape (``GET /realtime/metrics`` with the ``METRICS_TOKEN`` bearer) is
answered before Django's request path (realtime_app.routing.MetricsShortcut, in the
demo's asgi.py): the same text as the view, and no middleware on the way. Everything
else reaches Django as before. Found: a read's CPU was two thirds Django's request path
(the demo's seven middlewares, each a hop to a thread)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import pytest
from django.core.signals import request_started
from prometheus_client import CONTENT_TYPE_LATEST

from tests.asgi import application

TOKEN = "s3cret-token"


@pytest.fixture
def token(settings):
    settings.REALTIME_APP = {**settings.REALTIME_APP, "METRICS_TOKEN": TOKEN}


@pytest.fixture
def requests_seen():
    """Requests that went through Django's handler (it sends ``request_started`` for each)."""
    seen: list[Any] = []

    def note(sender: Any, scope: Any = None, **kwargs: Any) -> None:
        seen.append(scope)

    request_started.connect(note)
    yield seen
    request_started.disconnect(note)


async def get(
    app: Any,
    path: str,
    *,
    token: str | None = TOKEN,
    method: str = "GET",
    root_path: str = "",
    client: str = "127.0.0.1",
    body: bytes = b"",
) -> tuple:
    headers = [(b"host", b"127.0.0.1")]
    if token is not None:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    if body:
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": root_path + path,
        "raw_path": (root_path + path).encode(),
        "query_string": b"",
        "root_path": root_path,
        "headers": headers,
        "client": (client, 50000),
        "server": ("127.0.0.1", 80),
    }
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # the client stays until the answer (a disconnect aborts it)
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body.decode()


def shape(text: str) -> set[str]:
    """The families and each sample's name and labels, without the values (uptime moves)."""
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line}


async def test_a_scrape_with_the_token_skips_djangos_request_path_and_reads_the_same(hub, token, requests_seen):
    status, headers, text = await get(application, "/realtime/metrics")
    assert status == 200 and headers[b"content-type"] == CONTENT_TYPE_LATEST.encode()
    assert int(headers[b"content-length"]) == len(text.encode())
    assert requests_seen == []  # answered before Django
    assert re.search(r'^realtime_connections\{host="[^"]+",instance="[^"]+",pid="\d+"\} \d', text, re.M)
    django_app = application.application_mapping["http"].app  # what MetricsShortcut wraps
    status, _, through_django = await get(django_app, "/realtime/metrics")
    assert status == 200 and len(requests_seen) == 1
    assert shape(text) == shape(through_django)


@pytest.mark.parametrize(
    ("path", "method", "sent", "status"),
    [
        ("/realtime/metrics", "GET", None, 401),  # no token: Django's view answers
        ("/realtime/metrics", "GET", "wrong", 401),
        ("/realtime/metrics", "GET", TOKEN[:-1], 401),
        ("/realtime/metrics/", "GET", TOKEN, 404),
        ("/realtime/metricsx", "GET", TOKEN, 404),
        ("/realtime/api/health", "GET", TOKEN, 401),  # the token reads metrics only
    ],
)
async def test_anything_else_goes_through_django_as_before(hub, token, requests_seen, path, method, sent, status):
    assert (await get(application, path, token=sent, method=method))[0] == status
    assert len(requests_seen) == 1


async def test_other_methods_and_no_configured_token_go_through_django(hub, settings, requests_seen):
    settings.REALTIME_APP = {**settings.REALTIME_APP, "METRICS_TOKEN": None}
    assert (await get(application, "/realtime/metrics", token=""))[0] == 401  # "Bearer " matches no token
    settings.REALTIME_APP = {**settings.REALTIME_APP, "METRICS_TOKEN": TOKEN}
    status = (await get(application, "/realtime/metrics", method="POST"))[0]
    assert status != 200 and len(requests_seen) == 2


async def test_a_site_mounted_below_a_root_path_is_served_too(hub, token, requests_seen):
    status, _, text = await get(application, "/realtime/metrics", root_path="/mysite")
    assert status == 200 and "realtime_connections{" in text and requests_seen == []


# -- the publish API's door and readiness, answered here too --------------------------

PUBLISH_KEY = "publish-key-1"
BODY = b'{"channel": "test:events", "data": 1}'


@pytest.fixture
def publish_key(settings):
    settings.REALTIME_APP = {**settings.REALTIME_APP, "PUBLISH_API_KEYS": [PUBLISH_KEY]}


async def test_a_publish_without_a_valid_key_is_refused_before_django_and_a_flood_is_throttled(
    hub, publish_key, requests_seen, caplog
):
    from realtime_app.endpoint.doors import FAILURE_BURST

    app = application  # a fresh door per test: the mapping's MetricsShortcut is shared, so a new one
    door = type(app.application_mapping["http"])(app.application_mapping["http"].app)
    statuses = [
        (await get(door, "/realtime/api/publish", method="POST", token=key, client="198.51.100.50", body=BODY))[0]
        for key in (None, "wrong", *["wrong"] * int(FAILURE_BURST))
    ]
    assert statuses[: int(FAILURE_BURST)] == [401] * int(FAILURE_BURST)
    assert statuses[int(FAILURE_BURST) :] == [429] * 2
    assert requests_seen == []  # none of them went through Django's middleware
    status, headers, text = await get(door, "/realtime/api/publish", method="POST", token="x", client="198.51.100.50")
    assert status == 429 and int(headers[b"retry-after"]) >= 1 and json.loads(text)["retry_after_ms"] > 0
    # a real publisher behind the flooding address (one proxy for both) is never locked out
    status, _, _ = await get(
        door, "/realtime/api/publish", method="POST", token=PUBLISH_KEY, client="198.51.100.50", body=BODY
    )
    assert status == 202 and len(requests_seen) == 1
    # another address is not throttled by this one, and a valid key goes through to the view
    assert (await get(door, "/realtime/api/publish", method="POST", token="no", client="198.51.100.51"))[0] == 401
    status, _, text = await get(
        door, "/realtime/api/publish", method="POST", token=PUBLISH_KEY, client="198.51.100.51", body=BODY
    )
    assert status == 202 and "seq" in json.loads(text) and len(requests_seen) == 2
    assert door.publish_door.refused == {"key": int(FAILURE_BURST) + 1, "throttled": 3}
    said = [r for r in caplog.records if "publish API: refusing" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO"  # once while it lasts


async def test_the_failure_bucket_refills_on_its_clock():
    from realtime_app.endpoint.doors import FAILURE_BURST, FAILURE_REFILL_PER_S, PublishDoor

    now = [100.0]
    door = PublishDoor(clock=lambda: now[0])
    scope = {"client": ("203.0.113.5", 1), "headers": [(b"authorization", b"Bearer wrong")]}
    assert [door.answer(scope)[0] for _ in range(int(FAILURE_BURST) + 1)] == [401] * int(FAILURE_BURST) + [429]
    now[0] += 1 / FAILURE_REFILL_PER_S
    assert door.answer(scope)[0] == 401  # one token back: one more comparison
    assert door.answer(scope)[0] == 429


async def test_ready_is_answered_before_django_and_a_drain_is_no_error(hub, requests_seen, caplog):
    status, _, text = await get(application, "/realtime/ready", token=None)
    assert (status, json.loads(text)) == (200, {"ready": True}) and requests_seen == []
    hub.gate.draining = True
    try:
        for _ in range(3):  # a load balancer polls
            status, headers, text = await get(application, "/realtime/ready", token=None)
            assert (status, json.loads(text)) == (503, {"ready": False, "draining": True})
        assert headers[b"cache-control"] == b"no-store"
        assert (await get(application, "/realtime/ready", token=None, method="HEAD"))[0] == 503
    finally:
        hub.gate.draining = False
    assert requests_seen == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # Django logs every 5xx as ERROR
