"""Benchmark settings: the demo site on Redis plus a plain-Channels baseline endpoint."""

from project.settings import *  # noqa: F403

ASGI_APPLICATION = "bench.asgi.application"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
LOGGING = {"version": 1, "disable_existing_loggers": False, "root": {"level": "WARNING"}}
