from channels.generic.websocket import AsyncWebsocketConsumer

PLAIN_GROUP = "plain"


class PlainGroupConsumer(AsyncWebsocketConsumer):
    """An application's own consumer, living beside realtime_app in the same process."""

    async def connect(self) -> None:
        await self.channel_layer.group_add(PLAIN_GROUP, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(PLAIN_GROUP, self.channel_name)

    async def plain_message(self, event: dict) -> None:
        await self.send(text_data=event["text"])
