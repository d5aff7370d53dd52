"""HTTP probes: the cluster health JSON and Prometheus metrics (staff, or a metrics token);
and the one operator action, closing a connection (staff)."""

from __future__ import annotations

import hmac
import json
import logging

from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, JsonResponse

from realtime_app.conf import get_config
from realtime_app.exceptions import BackplaneUnavailable
from realtime_app.inbound.pools import pools_probe
from realtime_app.observability.logsafe import safe
from realtime_app.observability.probes import cluster_probe
from realtime_app.persistence.write_behind import stores_probe

__all__ = ["close_connection", "health", "metrics"]

logger = logging.getLogger("realtime_app.consumers")


async def _refusal(request: HttpRequest, *, allow_token: bool = False) -> HttpResponse | None:
    """None when the request may read probes: 401 anonymous, 403 non-staff."""
    if allow_token:
        token = get_config()["METRICS_TOKEN"]
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
    """The cluster probe; ``"unavailable"`` says why it is incomplete when the backplane
    does not answer (the page answers all the same: no page waits on Redis for long)."""
    problem = None
    if hasattr(request, "scope"):  # served by this ASGI process: include its own hub
        from realtime_app.hub.core import get_hub

        try:
            await get_hub()
        except BackplaneUnavailable as exc:
            problem = str(exc)
    probe = await cluster_probe()
    if problem is not None or not probe["complete"]:
        probe["unavailable"] = problem or "the backplane did not answer: other processes are not listed"
    # The serving process's HTTP pools, also under a WSGI server (which has no hub to publish them).
    probe["http_pools"] = pools_probe()
    probe["write_behind"] = stores_probe()
    return probe


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
    from realtime_app.exceptions import BackplaneUnavailable

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
