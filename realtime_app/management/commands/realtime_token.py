"""``manage.py realtime_token USERNAME [--ttl SECONDS] [--channel NAME ...]``: a connection
token for a user — a bot, a script, a test, a mobile app in development (docs/auth.md)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

__all__ = ["Command"]


class Command(BaseCommand):
    help = (
        "Print a connection token of USERNAME: a WebSocket handshake with 'Authorization: Bearer <token>' is that user."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--ttl", type=int, default=None, help="seconds it is valid (default TOKEN_TTL_S)")
        parser.add_argument(
            "--channel", action="append", default=[], help="a channel the holder may subscribe beyond the rules"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        from realtime_app.endpoint.tokens import issue

        model = get_user_model()
        try:
            user = model._default_manager.get_by_natural_key(options["username"])
        except model.DoesNotExist:
            raise CommandError(f"no user {options['username']!r}") from None
        if not getattr(user, "is_active", True):
            raise CommandError(f"user {options['username']!r} is inactive: its tokens would be refused")
        try:
            token, expires_at = issue(user, options["ttl"], options["channel"])
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(token)
        when = datetime.fromtimestamp(expires_at, tz=UTC).isoformat(timespec="seconds")
        self.stderr.write(f"valid until {when} ({expires_at})")
