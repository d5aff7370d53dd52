import asyncio
import itertools
import json

from channels.generic.websocket import AsyncWebsocketConsumer

from realtime_app.outbound.guard import GuardedSendMixin

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


class GuardedFloodConsumer(GuardedSendMixin, AsyncWebsocketConsumer):
    """An application's own consumer pushing 32 KiB frames at 100/s, guarded by realtime_app."""

    async def connect(self) -> None:
        await self.accept()
        self.task = asyncio.get_running_loop().create_task(self.flood())

    async def flood(self) -> None:
        blob = "y" * 32 * 1024
        for n in itertools.count():
            await self.send(text_data=json.dumps({"n": n, "blob": blob}))
            await asyncio.sleep(0.01)

    async def disconnect(self, code: int) -> None:
        self.task.cancel()
