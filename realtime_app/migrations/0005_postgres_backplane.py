"""The PostgreSQL backplane's tables and functions (realtime_app.cluster.postgres_sql), on
a PostgreSQL database only: nothing on other databases, nor any model (the backplane reads
and writes them through its own asyncio connections, never through the ORM)."""

from typing import Any

from django.db import migrations


def install(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        from realtime_app.cluster.postgres_sql import INSTALL

        schema_editor.execute(INSTALL)


def uninstall(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        from realtime_app.cluster.postgres_sql import DROP

        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [
        ("realtime_app", "0004_outbox"),
    ]

    operations = [migrations.RunPython(install, uninstall, elidable=False)]
