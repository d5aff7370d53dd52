"""System checks, collected at the top: each reads the settings (:mod:`realtime_app.conf`,
a leaf) and the package it checks, so that no lower package imports a higher one.

Importing this package registers them (``RealtimeAppConfig.ready``). Ids are stable and
listed in docs/checks.md.
"""

from realtime_app.checks import backplane, configuration, installation  # importing them registers them

__all__ = ["backplane", "configuration", "installation"]
