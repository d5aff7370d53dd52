"""Test settings: the demo site plus a test app; in-memory layer unless REDIS_URL is set."""

import json
import os
import sys
import tempfile

from project.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]  # noqa: F405
ROOT_URLCONF = "tests.urls"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast logins in tests
REALTIME_APP = {
    **REALTIME_APP,  # noqa: F405
    # A journal directory of this process's own (made only if a journal is written): nothing
    # left by another run is taken over.
    "WRITE_BEHIND_JOURNAL_DIR": os.path.join(tempfile.gettempdir(), f"rt-journal-{os.getpid()}"),
    # Test clients are all on 127.0.0.1: one that stands for a client of its own says its
    # address in X-Forwarded-For (tests/support/wsclient.py's RPC(address=...)); without that
    # header a socket's address is 127.0.0.1, as in production without a proxy.
    "TRUSTED_PROXIES": ["127.0.0.1"],
    # A stopped test server stops at once (a drain is tested with its own DRAIN_SECONDS).
    "DRAIN_SECONDS": 0,
    # Presence diffs every 200 ms: tests wait for them, not a second each.
    "PRESENCE_INTERVAL_MS": 200,
    "POLICIES": [
        *REALTIME_APP["POLICIES"],  # noqa: F405
        {"pattern": "test:staff", "staff": True},
        {"pattern": "test:perm", "permission": "auth.view_user"},
        {"pattern": "test:secret:<slug:name>", "check": "tests.testapp.realtime_channels.secret_check"},
        {"pattern": "test:backstage", "presence": {"staff": True}},
    ],
    "HTTP_POOLS": {
        **REALTIME_APP["HTTP_POOLS"],  # noqa: F405
        "test": {"max_concurrent": 2, "max_waiting": 8, "wait_timeout_ms": 5000},
    },
}
DATABASES["default"].setdefault("TEST", {})  # noqa: F405
if os.environ.get("REALTIME_TEST_DB_FILE"):
    DATABASES["default"]["TEST"]["NAME"] = os.environ["REALTIME_TEST_DB_FILE"]  # noqa: F405
# A second database, as a project with two has: publications on commit of its transactions
# (publish(using=)). Nothing of the app's lives there; tests that use it say so.
DATABASES["other"] = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}  # noqa: F405

# The test process's own hubs leave its heap alone: gc.get_referrers does not see frozen
# objects (Hypothesis's register_random then warns). The servers the tests start freeze
# theirs, as a served process does.
REALTIME_APP["FREEZE_STARTUP_OBJECTS"] = "pytest" not in sys.modules
# Fault and limit tests start servers with settings of their own, as JSON in the environment.
REALTIME_APP.update(json.loads(os.environ.get("REALTIME_TEST_OVERRIDES") or "{}"))
if os.environ.get("REALTIME_TEST_GROUP_EXPIRY") and "CONFIG" in CHANNEL_LAYERS["default"]:  # noqa: F405
    CHANNEL_LAYERS["default"]["CONFIG"]["group_expiry"] = int(os.environ["REALTIME_TEST_GROUP_EXPIRY"])  # noqa: F405
