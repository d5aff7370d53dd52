"""Django admin: the live "Realtime cluster" screen (staff), fed by the health channel."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, reverse

from realtime_app.declarations.registry import registry
from realtime_app.hub.hubs import start_failure
from realtime_app.models import RealtimeCluster
from realtime_app.realtime_channels import HEALTH_CHANNEL


@admin.register(RealtimeCluster)
class RealtimeClusterAdmin(admin.ModelAdmin):
    change_list_template = "admin/realtime_app/realtimecluster/change_list.html"
    #: Cadence of the health channel the screen follows, ms.
    refresh_ms = 2000
    #: The charts, each with its unit: ``data-chart`` name and title.
    charts = [
        ("frames_out", "Frames out per second, per process"),
        ("queued_bytes", "Bytes queued for clients, per process"),
        ("drops_closes", "Frames dropped, conflated, and 1013 closes, per second"),
        ("admission", "Admission decisions per second (stacked)"),
        ("http_pools", "HTTP pools: requests running, waiting, and 503 per second"),
        ("http_wait", "HTTP pools: wait p99 (ms)"),
        ("write_behind", "Write-behind: unsaved objects and failed flushes in a row"),
        ("write_behind_age", "Write-behind: oldest unsaved change (s)"),
        ("resumes", "History resumes per second: recovered, failed, replayed, gaps"),
        ("cpu", "CPU per process (% of a core)"),
        ("memory", "Resident memory per process (bytes)"),
    ]

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return bool(request.user.is_active and request.user.is_staff)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        if not self.has_view_permission(request):
            from django.core.exceptions import PermissionDenied

            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": "Realtime cluster",
            "opts": self.model._meta,
            "health_channel": registry.resolve(f"{HEALTH_CHANNEL}:{self.refresh_ms}").name,  # canonical
            "charts": self.charts,
            "close_url": _close_url(),
            "backplane_down": start_failure(),  # what this process knows, no I/O: the page never waits on Redis
            **(extra_context or {}),
        }
        return TemplateResponse(request, self.change_list_template, context)


def _close_url() -> str | None:
    """Where the screen posts a close (None when the project did not include the app's URLs:
    the screen then offers no close button)."""
    try:
        return str(reverse("realtime_app:close-connection"))
    except NoReverseMatch:
        return None
