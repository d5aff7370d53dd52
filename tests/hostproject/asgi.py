"""The host project's ASGI application: its own routes beside the app's, under the app's
auth stack, behind the project's own JWT middleware."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.hostproject.settings")

from django.core.asgi import get_asgi_application

django_asgi = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.urls import path  # noqa: E402

from realtime_app.routing import AuthMiddlewareStack, websocket_urlpatterns  # noqa: E402
from tests.hostproject.middleware import JWTAuthMiddleware  # noqa: E402
from tests.hostproject.shop.consumers import ChatConsumer  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi,
        "websocket": JWTAuthMiddleware(
            AuthMiddlewareStack(
                URLRouter(
                    [
                        path("chat/", ChatConsumer.as_asgi()),
                        path("chat-pubsub/", ChatConsumer.as_asgi(channel_layer_alias="pubsub")),
                        *websocket_urlpatterns,
                    ]
                )
            )
        ),
    }
)
