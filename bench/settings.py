"""Benchmark settings: the demo site on Redis plus a plain-Channels baseline endpoint."""

from project.settings import *  # noqa: F403

ASGI_APPLICATION = "bench.asgi.application"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
LOGGING = {"version": 1, "disable_existing_loggers": False, "root": {"level": "WARNING"}}

import json  # noqa: E402
import os  # noqa: E402

# The benchmarks' thousands of sockets stand for thousands of clients, all on 127.0.0.1:
# each says its own address in X-Forwarded-For (bench/common.py's as_new_client), trusted
# from 127.0.0.1, so that per-address limits apply per client as in production.
REALTIME_APP = {**REALTIME_APP, "TRUSTED_PROXIES": ["127.0.0.1"]}  # noqa: F405
# bench/supabase.py's users publish to their own channels (bench:room:<id>).
REALTIME_APP["POLICIES"] = [*REALTIME_APP.get("POLICIES", []), {"pattern": "bench:room:*", "publish": True}]
# A benchmark phase may change REALTIME_APP keys (admission off, say) through the environment.
REALTIME_APP = {**REALTIME_APP, **json.loads(os.environ.get("REALTIME_BENCH_OVERRIDES") or "{}")}
