"""HTTP probes: the cluster health JSON (staff only)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse

from .probes import cluster_probe

__all__ = ["health"]


async def health(request: HttpRequest) -> HttpResponse:
    """``GET /realtime/api/health``: every live process's probe. 401 anonymous, 403 non-staff."""
    user = await request.auser()
    if not user.is_authenticated:
        return JsonResponse({"error": "authentication required"}, status=401)
    if not (user.is_active and user.is_staff):
        return JsonResponse({"error": "staff only"}, status=403)
    return JsonResponse(await cluster_probe())
