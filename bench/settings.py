"""Benchmark settings: the demo site on Redis plus a plain-Channels baseline endpoint."""

from project.settings import *  # noqa: F403

ASGI_APPLICATION = "bench.asgi.application"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
LOGGING = {"version": 1, "disable_existing_loggers": False, "root": {"level": "WARNING"}}

import json  # noqa: E402
import os  # noqa: E402

# The benchmarks open thousands of sockets from 127.0.0.1: one anonymous address, which the
# per-address connection and handshake limits would refuse (bench/admission.py turns them
# back on, with clients of their own addresses behind a trusted proxy header).
REALTIME_APP = {**REALTIME_APP, "MAX_CONNECTIONS_PER_ADDRESS": 0, "HANDSHAKES_PER_S": 0}  # noqa: F405
# A benchmark phase may change REALTIME_APP keys (admission off, say) through the environment.
REALTIME_APP = {**REALTIME_APP, **json.loads(os.environ.get("REALTIME_BENCH_OVERRIDES") or "{}")}
