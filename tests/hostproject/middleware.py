"""The project's own JWT-style middleware, in front of the auth stack as Channels' docs
show it (``JWTAuthMiddleware(AuthMiddlewareStack(...))``): a header ``Authorization:
Bearer jwt.<username>`` is that user; any other Bearer is not its business."""

from channels.db import database_sync_to_async
from django.contrib.auth import get_user_model

PREFIX = "jwt."


@database_sync_to_async
def _user(username):
    return get_user_model().objects.filter(username=username).first()


class JWTAuthMiddleware:
    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        header = dict(scope.get("headers", ())).get(b"authorization", b"").decode()
        kind, _, token = header.partition(" ")
        if kind.lower() == "bearer" and token.startswith(PREFIX):
            user = await _user(token[len(PREFIX) :])
            if user is not None:
                scope = {**scope, "user": user}
        return await self.inner(scope, receive, send)
