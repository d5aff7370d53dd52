"""Create the demo users (DEBUG demo only): demo/demo and admin/admin."""

from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Create the demo users demo/demo (ordinary) and admin/admin (staff superuser)."

    def handle(self, *args: Any, **options: Any) -> None:
        if not settings.DEBUG:
            raise CommandError("demo users are created only with DEBUG on (this is the demo site)")
        User = get_user_model()
        for username, staff in (("demo", False), ("admin", True)):
            user, created = User.objects.get_or_create(username=username)
            if created:
                user.set_password(username)
                user.is_staff = user.is_superuser = staff
                user.save()
                self.stdout.write(f"created user {username}/{username}")
