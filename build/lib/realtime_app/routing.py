"""URL routes of the WebSocket endpoint, for the project's ``URLRouter``."""

from __future__ import annotations

from django.urls import path

from .consumers import RealtimeConsumer

__all__ = ["websocket_urlpatterns"]

websocket_urlpatterns = [path("realtime/", RealtimeConsumer.as_asgi())]
