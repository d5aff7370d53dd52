"""The system checks' errors, said in the server's log when its hub starts: daphne and
uvicorn run no checks, so a rule that guards nothing (E015) or a journal directory that
cannot be written (E031) would otherwise be found only when a client is refused or data is
lost. Said once a process, after the hub started (the checks read no backplane)."""

from __future__ import annotations

import logging

__all__ = ["log_check_errors"]

logger = logging.getLogger("realtime_app.checks")

_said = False


def log_check_errors() -> int:
    """Log each error of this app's system checks once a process, as ERROR; how many."""
    global _said
    if _said:
        return 0
    _said = True
    from django.apps import apps
    from django.core.checks import ERROR, run_checks

    try:
        messages = run_checks(app_configs=[apps.get_app_config("realtime_app")])
    except Exception:  # a check that fails is the check command's to report
        logger.exception("the system checks failed at start")
        return 0
    errors = [m for m in messages if m.level >= ERROR and str(m.id or "").startswith("realtime_app.")]
    for message in errors:
        logger.error("%s: %s %s (manage.py check)", message.id, message.msg, message.hint or "")
    return len(errors)
