"""Channels as the application declares them: the registry of families, tickers, state
and event channels (``declare``, ``registry``, ``templates``), who may subscribe
(``policies``), per-object instances (``instances``) and which rules match nothing
(``coverage``).

Named ``declarations`` rather than ``channels`` so that a traceback or an import never
reads as Django Channels' own top-level package."""
