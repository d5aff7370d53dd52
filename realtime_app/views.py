"""HTTP probes: the cluster health JSON and Prometheus metrics (staff, or a metrics token);
the one operator action, closing a connection (staff); connection tokens for a signed-in
session; and the publish API for services in any language (docs/auth.md)."""

from __future__ import annotations

import hmac
import json
import logging

from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, JsonResponse

from realtime_app.conf.runtime import runtime, settings
from realtime_app.exceptions import BackplaneUnavailable
from realtime_app.observability.logsafe import safe
from realtime_app.observability.probes import served_probe
from realtime_app.wire.protocol import MAX_DEPTH, scan

__all__ = ["close_connection", "health", "http_endpoint", "issue_token", "metrics", "publish_api", "ready"]

logger = logging.getLogger("realtime_app.consumers")


async def _refusal(request: HttpRequest, *, allow_token: bool = False) -> HttpResponse | None:
    """None when the request may read probes: 401 anonymous, 403 non-staff."""
    if allow_token:
        token = settings().metrics_token
        header = request.headers.get("Authorization", "")
        if token and hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
            return None
    user = await request.auser()
    if not user.is_authenticated:
        response = JsonResponse({"error": "authentication required"}, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="realtime"'
        return response
    if not (user.is_active and user.is_staff):
        return JsonResponse({"error": "staff only"}, status=403)
    return None


async def _probe(request: HttpRequest) -> dict[str, object]:
    return await served_probe(serving=hasattr(request, "scope"))  # served by this ASGI process: its own hub too


async def health(request: HttpRequest) -> HttpResponse:
    """``GET /realtime/api/health``: every live process's probe, as JSON."""
    refusal = await _refusal(request)
    if refusal is not None:
        return refusal
    probe = await _probe(request)
    return JsonResponse(probe, status=503 if "unavailable" in probe and not probe["instances"] else 200)


async def metrics(request: HttpRequest) -> HttpResponse:
    """``GET /realtime/metrics``: the cluster probe in Prometheus' text format."""
    refusal = await _refusal(request, allow_token=True)
    if refusal is not None:
        return refusal
    from prometheus_client import CONTENT_TYPE_LATEST

    from realtime_app.observability.metrics import render

    return HttpResponse(render(await _probe(request)), content_type=CONTENT_TYPE_LATEST)


async def close_connection(request: HttpRequest) -> HttpResponse:
    """``POST /realtime/api/connections/close`` with ``{"instance": str, "connection": int}``
    (staff, with Django's CSRF token): the process holding it closes it with 4010."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    refusal = await _refusal(request)
    if refusal is not None:
        return refusal
    try:
        body = json.loads(request.body)
        instance, connection = body["instance"], body["connection"]
        if not isinstance(instance, str) or isinstance(connection, bool) or not isinstance(connection, int):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": 'expected {"instance": str, "connection": int}'}, status=400)
    from realtime_app.endpoint.operator import close_connection as close

    user = await request.auser()
    logger.warning(
        "staff user %s asked to close connection %s of %s (from %s)",
        safe(user.get_username(), 150),
        connection,
        safe(instance, 150),
        safe(request.META.get("REMOTE_ADDR", "?"), 60),
    )
    try:
        await close(instance, connection, user.get_username())
    except BackplaneUnavailable:
        return JsonResponse({"error": "the cluster cannot be told now (backplane unavailable)"}, status=503)
    return JsonResponse({"sent": True, "instance": instance, "connection": connection}, status=202)


async def issue_token(request: HttpRequest) -> HttpResponse:
    """``POST /realtime/api/token`` (a signed-in session, with Django's CSRF token):
    ``{"token", "expires_at"}``, a connection token of the session's user. Optional JSON
    body ``{"ttl": seconds}`` (at most ``TOKEN_MAX_TTL_S``)."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    user = await request.auser()
    if not user.is_authenticated:
        return JsonResponse({"error": "authentication required"}, status=401)
    ttl = None
    if request.body:
        try:
            ttl = json.loads(request.body).get("ttl")
            if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int)):
                raise TypeError
        except (ValueError, TypeError, AttributeError):
            return JsonResponse({"error": 'expected {"ttl": seconds} or no body'}, status=400)
    from realtime_app.endpoint.tokens import issue

    try:
        token, expires_at = issue(user, ttl)
    except ValueError as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    response = JsonResponse({"token": token, "expires_at": expires_at})
    response["Cache-Control"] = "no-store"  # a credential: never kept by a cache
    return response


#: Publications in one batch of the publish API, at most.
PUBLISH_BATCH = 100


async def publish_api(request: HttpRequest) -> HttpResponse:
    """``POST /realtime/api/publish`` with ``Authorization: Bearer <key>`` (a key of
    ``PUBLISH_API_KEYS``): ``{"channel", "data"}`` answers 202 ``{"channel", "seq"}``;
    ``{"publications": [{"channel", "data"}, ...]}`` (at most 100) answers 202
    ``{"results": [{"channel", "seq"} or {"channel", "error"}]}``. 401 without a valid key,
    413 over ``MAX_PUBLICATION_BYTES`` (a publication, or a body of more than a batch of them)."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    from realtime_app.endpoint.doors import valid_key

    config = settings()
    if not valid_key(request.headers.get("Authorization", "").encode()):  # MetricsShortcut checked it first
        response = JsonResponse({"error": "a key of PUBLISH_API_KEYS is required"}, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="realtime publish"'
        return response
    from django.conf import settings as django_settings

    bound = int(config.max_publication_bytes) * PUBLISH_BATCH  # a batch's worth, within Django's own bound
    if django_settings.DATA_UPLOAD_MAX_MEMORY_SIZE is not None:
        bound = min(bound, django_settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
    declared = request.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > bound:
        return JsonResponse({"error": f"body over {bound} bytes"}, status=413)
    from django.core.exceptions import RequestDataTooBig

    try:
        raw = request.body  # bounded by DATA_UPLOAD_MAX_MEMORY_SIZE too
    except RequestDataTooBig:
        return JsonResponse({"error": "body over DATA_UPLOAD_MAX_MEMORY_SIZE"}, status=413)
    try:
        body = json.loads(raw)
        batch = body["publications"] if "publications" in body else None
        items = batch if batch is not None else [body]
        if not isinstance(items, list) or not items or len(items) > PUBLISH_BATCH:
            raise TypeError
        pairs = [(item["channel"], item["data"]) for item in items]
        if not all(isinstance(channel, str) for channel, _ in pairs):
            raise TypeError
    except RecursionError:
        return JsonResponse({"error": f"body nested deeper than {MAX_DEPTH} levels", "reason": "too_deep"}, status=400)
    except (ValueError, KeyError, TypeError, AttributeError):
        shape = f'{{"channel": name, "data": json}} or {{"publications": [...]}} (at most {PUBLISH_BATCH})'
        return JsonResponse({"error": f"expected {shape}"}, status=400)
    if any(scan(data)[0] > MAX_DEPTH for _, data in pairs):  # as on the socket: never a recursion error later
        return JsonResponse(
            {"error": f"data nested deeper than {MAX_DEPTH} levels", "reason": "too_deep", "limit": MAX_DEPTH},
            status=400,
        )
    results = [await _publish_one(channel, data) for channel, data in pairs]
    if batch is None:
        (result,) = results
        status = result.pop("status")
        return JsonResponse(result, status=status)
    for result in results:
        del result["status"]
    return JsonResponse({"results": results}, status=202)


publish_api.csrf_exempt = True  # type: ignore[attr-defined]  # a service with a key, not a browser's cookie


async def _publish_one(channel: str, data: object) -> dict[str, object]:
    from realtime_app.declarations.instances import exists
    from realtime_app.declarations.registry import registry
    from realtime_app.exceptions import PublicationTooLarge, RealtimeError, RPCError, UnknownChannel
    from realtime_app.hub.publishing import apublish

    try:  # an outside service is no application code: an instance its template's hook denies is unknown
        if not await exists(registry.resolve(channel), ask_again_if_not=True):
            raise UnknownChannel(channel)
    except UnknownChannel:
        return {"channel": channel, "error": "unknown channel", "status": 404}
    except RPCError:  # the hook raised (logged there): its database is down, come back later
        return {"channel": channel, "error": "exists hook failed", "status": 503}
    except (RealtimeError, ValueError, TypeError) as exc:
        return {"channel": channel, "error": safe(str(exc), 300), "status": 400}
    try:
        seq = await apublish(channel, data)
    except PublicationTooLarge as exc:
        return {"channel": channel, "error": str(exc), "status": 413}
    except UnknownChannel:
        return {"channel": channel, "error": "unknown channel", "status": 404}
    except BackplaneUnavailable:
        return {"channel": channel, "error": "backplane unavailable", "status": 503}
    except (RealtimeError, ValueError, TypeError) as exc:
        return {"channel": channel, "error": safe(str(exc), 300), "status": 400}
    result: dict[str, object] = {"channel": channel, "status": 202}
    if seq is not None:
        result["seq"] = seq
    return result


async def ready(request: HttpRequest) -> HttpResponse:
    """``GET /realtime/ready``: 200 while this process takes connections, 503 once it
    drains (SIGTERM), or while a write-behind journal cannot be written: what a load
    balancer's readiness check reads. No auth, no Redis. :class:`~realtime_app.routing.MetricsShortcut`
    answers it before Django (whose log has every 5xx as an ERROR)."""
    from realtime_app.endpoint.doors import readiness

    status, body, _ = readiness()
    return JsonResponse(body, status=status)


async def http_endpoint(request: HttpRequest) -> HttpResponse:
    """``/realtime/sse`` and ``/realtime/rpc`` reached Django: the project's HTTP
    application is not wrapped in ``realtime_app.routing.MetricsShortcut``, which serves
    them (a stream must reach past Django to the server's transport). Say so, once."""
    if runtime().first_time("http endpoint unrouted"):
        logger.error(
            "%s reached Django: wrap the project's HTTP application in realtime_app.routing.MetricsShortcut "
            "(docs/sse.md) to serve Server-Sent Events and JSON-RPC over HTTP",
            safe(request.path),
        )
    body = {"error": "not served here: wrap the HTTP application in realtime_app.routing.MetricsShortcut"}
    return JsonResponse(body, status=501)
