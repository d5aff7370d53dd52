"""AppConfig: register the system checks and the settings-reset signal, discover channels."""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.core.signals import request_started, setting_changed
from django.utils.module_loading import autodiscover_modules


async def start_hub_with_first_request(sender: Any, scope: dict[str, Any] | None = None, **kwargs: Any) -> None:
    """Start this process's hub at its first ASGI HTTP request (not only its first
    WebSocket), so that it joins the cluster view early — in the background: no page
    waits for the backplane, and none fails when Redis is down. WSGI requests carry no
    scope."""
    if scope is None:
        return
    from realtime_app.hub.hubs import start_hub_soon

    start_hub_soon()


class RealtimeAppConfig(AppConfig):
    name = "realtime_app"
    verbose_name = "Realtime"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.conf import settings
        from django.contrib.auth.signals import user_logged_out

        from realtime_app import checks  # noqa: F401  (registers the checks, the first afternoon's included)
        from realtime_app.cluster import online_checks  # noqa: F401  (registers the deployment check)
        from realtime_app.cluster.layer_timeouts import unbounded_layer_reads
        from realtime_app.conf import apply_json_encoder
        from realtime_app.conf.runtime import on_setting_changed, runtime
        from realtime_app.endpoint.sessions import on_logout
        from realtime_app.persistence import checks as store_checks  # noqa: F401  (registers the store checks)

        apply_json_encoder()
        unbounded_layer_reads(getattr(settings, "CHANNEL_LAYERS", {}))  # the project's consumers stay open idle

        # the one place a running process takes new settings (the reload rule: conf.runtime)
        setting_changed.connect(on_setting_changed, dispatch_uid="realtime_app.settings_changed")
        user_logged_out.connect(on_logout, dispatch_uid="realtime_app.on_logout")
        request_started.connect(start_hub_with_first_request, dispatch_uid="realtime_app.start_hub")
        # Importing each app's channel module registers its families (no I/O).
        autodiscover_modules(runtime().settings.autodiscover_module)
