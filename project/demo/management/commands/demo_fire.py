"""``manage.py demo_fire USER SHOTS``: fire shots from a user's inventory outside the server.

A command uses the write-behind store like the server does; what it accepted is flushed
when it ends (docs/write-behind.md).
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser


class Command(BaseCommand):
    help = "Fire SHOTS shots of ammo from USER's inventory (one accepted mutation per shot)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("user")
        parser.add_argument("shots", type=int)

    def handle(self, *args: Any, **options: Any) -> None:
        from project.demo.inventory import store

        user = get_user_model().objects.filter(username=options["user"]).first()
        if user is None:
            raise CommandError(f"no user {options['user']!r}")

        async def fire() -> int:
            left = 0
            for _ in range(options["shots"]):
                accepted = await store.add((user.pk, "ammo"), "shots", -1)
                assert accepted.state is not None
                left = accepted.state["shots"]
            return left

        left = async_to_sync(fire)()
        self.stdout.write(f"{options['shots']} shots accepted, {left} left (durable when the command ends)")
