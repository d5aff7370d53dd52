"""AppConfig: register the system checks and the settings-reset signal, discover channels."""

from __future__ import annotations

from django.apps import AppConfig
from django.core.signals import setting_changed
from django.utils.module_loading import autodiscover_modules


class RealtimeAppConfig(AppConfig):
    name = "realtime_app"
    verbose_name = "Realtime"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the checks)
        from .conf import get_config, reset_config

        setting_changed.connect(reset_config, dispatch_uid="realtime_app.reset_config")
        # Importing each app's channel module registers its families (no I/O).
        autodiscover_modules(get_config()["AUTODISCOVER_MODULE"])
