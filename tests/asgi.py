"""ASGI app of the tests: the demo site plus a plain Channels consumer at /plain/."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

from channels.routing import ProtocolTypeRouter, URLRouter
from django.urls import path

from project.asgi import application as demo_application
from realtime_app.routing import AuthMiddlewareStack, OriginValidator, not_found_urlpatterns, websocket_urlpatterns
from tests.testapp.consumers import GuardedFloodConsumer, PlainGroupConsumer

application = ProtocolTypeRouter(
    {
        "http": demo_application.application_mapping["http"],
        "lifespan": demo_application.application_mapping["lifespan"],
        "websocket": OriginValidator(
            AuthMiddlewareStack(
                URLRouter(
                    [
                        *websocket_urlpatterns,
                        path("plain/", PlainGroupConsumer.as_asgi()),
                        path("guarded/", GuardedFloodConsumer.as_asgi()),
                        *not_found_urlpatterns,
                    ]
                )
            )
        ),
    }
)
