"""An ASGI application that routes the realtime endpoint without an auth middleware (the
mistake check W041 names)."""

from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator

from realtime_app.routing import websocket_urlpatterns

application = ProtocolTypeRouter({"websocket": AllowedHostsOriginValidator(URLRouter(websocket_urlpatterns))})
