"""ASGI entry point of the demo site: HTTP through Django, WebSocket through realtime_app."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
django_asgi_app = get_asgi_application()

from django.conf import settings  # noqa: E402

if settings.DEBUG:  # the demo serves its static files itself (daphne alone does not)
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    django_asgi_app = ASGIStaticFilesHandler(django_asgi_app)

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402

from realtime_app.lifespan import lifespan_app  # noqa: E402
from realtime_app.routing import (  # noqa: E402
    AuthMiddlewareStack,
    MetricsShortcut,
    OriginValidator,
    not_found_urlpatterns,
    websocket_urlpatterns,
)

application = ProtocolTypeRouter(
    {
        "http": MetricsShortcut(django_asgi_app),  # a scrape with METRICS_TOKEN skips the middleware
        # Channels' AllowedHostsOriginValidator, and tokens past it (docs/auth.md)
        "websocket": OriginValidator(AuthMiddlewareStack(URLRouter([*websocket_urlpatterns, *not_found_urlpatterns]))),
        "lifespan": lifespan_app,  # uvicorn: flush the write-behind stores at shutdown
    }
)
