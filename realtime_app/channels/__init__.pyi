# Type checkers read the deprecated alias as the package it stands for.
from realtime_app.declarations import coverage as coverage
from realtime_app.declarations import declare as declare
from realtime_app.declarations import instances as instances
from realtime_app.declarations import policies as policies
from realtime_app.declarations import registry as registry
from realtime_app.declarations import templates as templates

SUBMODULES: tuple[str, ...]
