"""The shop's own consumer: a chat room on the channel layer it is given, telling each
client who it is and whether it has a session; ``{"login": username}`` signs the socket in
with ``channels.auth.login`` (and saves the session), ``{"logout": true}`` out."""

from asgiref.sync import sync_to_async
from channels.auth import login, logout
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.contrib.auth import get_user_model

GROUP = "lobby"


class ChatConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        await self.channel_layer.group_add(GROUP, self.channel_name)
        await self.accept()
        await self.send_json(self.whoami())

    def whoami(self):
        user = self.scope.get("user")
        return {
            "user": user.get_username() if getattr(user, "is_authenticated", False) else None,
            "session": "session" in self.scope,
        }

    async def receive_json(self, content, **kwargs):
        if "login" in content:
            user = await sync_to_async(get_user_model().objects.get)(username=content["login"])
            await login(self.scope, user)
            await sync_to_async(self.scope["session"].save)()
            await self.send_json({"logged_in": self.whoami()})
        elif content.get("logout"):
            await logout(self.scope)
            await self.send_json({"logged_out": self.whoami()})

    async def chat_message(self, event):
        await self.send_json({"message": event["text"]})

    async def disconnect(self, code):
        await self.channel_layer.group_discard(GROUP, self.channel_name)
