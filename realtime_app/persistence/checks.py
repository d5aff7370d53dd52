"""The write-behind stores' system checks: a store that cannot make the rows it may need,
and a journal directory that could not keep what an outage leaves unsaved.

Stores are found among those created by the time checks run: declare them at the top
level of a module Django imports at start (the module of your ``@rpc_method`` functions,
a ``models.py``), as the demo's ``project/demo/inventory.py`` is. Ids in docs/checks.md.
"""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Tags, register

from realtime_app.persistence import journal, lifecycle

__all__ = ["check_stores"]


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
