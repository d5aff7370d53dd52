"""The write-behind stores' system checks: a store that cannot make the rows it may need,
and a journal directory that could not keep what an outage leaves unsaved.

Stores are found among those created by the time checks run: declare them at the top
level of a module Django imports at start (the module of your ``@rpc_method`` functions,
a ``models.py``), as the demo's ``project/demo/inventory.py`` is. Ids in docs/checks.md.
"""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Tags, Warning, register

from realtime_app.persistence import journal, lifecycle

__all__ = ["check_outbox", "check_outbox_databases", "check_stores"]


@register(Tags.models)
def check_stores(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E030 for a store that cannot create rows; E031 for an unusable journal directory."""
    stores = lifecycle.stores()
    messages: list[CheckMessage] = [
        Error(
            problem,
            hint="Give the store create=lambda key: {field: value, ...} for those fields, or create=False "
            "if its rows always exist (docs/write-behind.md#which-models).",
            obj=store.name,
            id="realtime_app.E030",
        )
        for store in stores
        for problem in store.problems()
    ]
    if stores:
        why = journal.problem(journal.journal_dir())
        if why is not None:
            messages.append(
                Error(
                    f"The write-behind journal directory cannot be used: {why}. A stop during a database "
                    "outage would lose the changes the stores accepted.",
                    hint="Set REALTIME_APP['WRITE_BEHIND_JOURNAL_DIR'] to a directory of the process's "
                    "own user, not writable by others, that outlives a restart (docs/write-behind.md).",
                    id="realtime_app.E031",
                )
            )
    return messages


@register(Tags.compatibility)
def check_outbox_databases(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """E032: ``OUTBOX_DATABASES`` names a database that is not in ``DATABASES``."""
    from django.conf import settings as django_settings

    from realtime_app.conf import get_config

    listed = get_config()["OUTBOX_DATABASES"]
    if not isinstance(listed, (list, tuple)):
        listed = [listed]
    unknown = [alias for alias in listed if alias not in django_settings.DATABASES]
    if not unknown:
        return []
    return [
        Error(
            f"REALTIME_APP['OUTBOX_DATABASES'] names {unknown!r}, not in DATABASES: nothing drains its outbox.",
            hint="List the aliases of DATABASES whose transactions publish on durable channels.",
            id="realtime_app.E032",
        )
    ]


@register(Tags.database)
def check_outbox(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W032 (``check --database``): the outbox of durable channels holds ``OUTBOX_MAX_ROWS``
    rows or more, or a row older than ``OUTBOX_MAX_AGE_S``: nothing drains it."""
    import datetime

    from django.db import DatabaseError

    from realtime_app.conf import get_config
    from realtime_app.persistence import outbox

    config = get_config()
    messages: list[CheckMessage] = []
    for alias in databases or []:
        if alias not in config["OUTBOX_DATABASES"]:
            continue
        try:
            rows, oldest = outbox.stats(alias)
        except DatabaseError:  # not migrated yet: migrate's own business
            continue
        age = (datetime.datetime.now(datetime.UTC) - oldest).total_seconds() if oldest is not None else 0.0
        if rows >= int(config["OUTBOX_MAX_ROWS"]) or age > float(config["OUTBOX_MAX_AGE_S"]):
            messages.append(
                Warning(
                    f"The outbox of database {alias!r} holds {rows} row(s), the oldest {age:.0f} s old: "
                    "durable publications are not going out.",
                    hint="Check that the backplane answers and that a server process runs (each drains the "
                    "outbox); the probe's outbox says more (docs/transactions.md).",
                    id="realtime_app.W032",
                )
            )
    return messages
