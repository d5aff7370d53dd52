"""An ASGI application that routes the realtime endpoint behind Channels' own
``AuthMiddlewareStack`` (check W042): sessions work, connection tokens are never read."""

from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter

from realtime_app.routing import websocket_urlpatterns

application = ProtocolTypeRouter({"websocket": AuthMiddlewareStack(URLRouter(websocket_urlpatterns))})
