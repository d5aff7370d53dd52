"""The system checks' errors, said in the server's log when its hub starts: daphne and
uvicorn run no checks, so a rule that guards nothing (E015) or a journal directory that
cannot be written (E031) would otherwise be found only when a client is refused or data is
lost. Only this app's own checks, each on its own (one that fails costs only itself), in a
worker thread (a check may read the disk or the ORM); once a process."""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import sync_to_async

from realtime_app.conf.runtime import runtime

__all__ = ["check_errors", "log_check_errors"]

logger = logging.getLogger("realtime_app.checks")


def check_errors() -> list[Any]:
    """The errors of this app's registered system checks (deployment checks excepted)."""
    from django.core.checks import ERROR
    from django.core.checks.registry import registry

    errors: list[Any] = []
    for check in registry.get_checks(include_deployment_checks=False):
        if not str(getattr(check, "__module__", "")).startswith("realtime_app."):
            continue
        try:
            errors += [m for m in check(app_configs=None) if m.level >= ERROR]
        except Exception:  # the check command reports it; the others are said all the same
            logger.exception("system check %s failed at start", getattr(check, "__name__", check))
    return errors


async def log_check_errors() -> int:
    """Log each error of this app's system checks once a process, as ERROR; how many."""
    if not runtime().first_time("check errors"):
        return 0
    errors = await sync_to_async(check_errors, thread_sensitive=False)()
    for message in errors:
        logger.error("%s: %s %s (manage.py check)", message.id, message.msg, message.hint or "")
    return len(errors)
