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
    from realtime_app.hub.core import start_hub_soon

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
        from realtime_app.conf import apply_json_encoder, get_config, reset_config
        from realtime_app.declarations.policies import reset_rules
        from realtime_app.endpoint.sessions import on_logout
        from realtime_app.hub.gate import reconfigure_gates
        from realtime_app.persistence import checks as store_checks  # noqa: F401  (registers the store checks)

        apply_json_encoder()
        unbounded_layer_reads(getattr(settings, "CHANNEL_LAYERS", {}))  # the project's consumers stay open idle

        setting_changed.connect(reset_config, dispatch_uid="realtime_app.reset_config")
        setting_changed.connect(reset_rules, dispatch_uid="realtime_app.reset_rules")
        # after reset_config (connected first): the gates read the new settings
        setting_changed.connect(reconfigure_gates, dispatch_uid="realtime_app.reconfigure_gates")
        user_logged_out.connect(on_logout, dispatch_uid="realtime_app.on_logout")
        request_started.connect(start_hub_with_first_request, dispatch_uid="realtime_app.start_hub")
        # Importing each app's channel module registers its families (no I/O).
        autodiscover_modules(get_config()["AUTODISCOVER_MODULE"])
