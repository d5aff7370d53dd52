"""ASGI app of the tests: the demo site plus a plain Channels consumer at /plain/."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

from project.asgi import application as demo_application  # noqa: E402

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.urls import path  # noqa: E402

from realtime_app.routing import websocket_urlpatterns  # noqa: E402
from tests.testapp.consumers import PlainGroupConsumer  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": demo_application.application_mapping["http"],
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter([*websocket_urlpatterns, path("plain/", PlainGroupConsumer.as_asgi())]))
        ),
    }
)
