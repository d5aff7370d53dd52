"""Settings of the demo site. Environment: REALTIME_BACKPLANE ("postgres": the cluster on
DATABASE_URL's PostgreSQL), REDIS_URL (several, comma-separated: the
backplane's shards, docs/capacity.md), REALTIME_CHANNEL_LAYER (``pubsub`` for
channels-redis' pub/sub layer), DATABASE_URL, REALTIME_DEMO_FLOOD."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import unquote, urlparse

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "demo-only-insecure-key-change-me")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "realtime_app",
    "project.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "realtime_app.middleware.ConcurrencyLimitMiddleware",
]

ROOT_URLCONF = "project.urls"
ASGI_APPLICATION = "project.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]


def _database(url: str | None) -> dict[str, object]:
    """DATABASE_URL: sqlite:///path (default db.sqlite3) or postgres://user:pass@host:port/name."""
    if not url:
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "db.sqlite3"}
    parsed = urlparse(url)
    if parsed.scheme == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": unquote(parsed.path[1:]) or ":memory:"}
    engines = {"postgres": "postgresql", "postgresql": "postgresql", "mysql": "mysql"}
    if parsed.scheme not in engines:
        raise ValueError(f"DATABASE_URL scheme {parsed.scheme!r} is not one of sqlite, postgres, mysql")
    return {
        "ENGINE": f"django.db.backends.{engines[parsed.scheme]}",
        "NAME": unquote(parsed.path[1:]),
        "USER": unquote(parsed.username or ""),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": parsed.hostname or "",
        "PORT": str(parsed.port or ""),
    }


DATABASES = {"default": _database(os.environ.get("DATABASE_URL"))}

REDIS_URL = os.environ.get("REDIS_URL")
# The backplane on a Redis Cluster (its node URLs, comma-separated); the channel layer stays
# on REDIS_URL (a plain Redis: channels-redis cannot use a cluster) or in memory.
REDIS_CLUSTER = [url.strip() for url in os.environ.get("REDIS_CLUSTER", "").split(",") if url.strip()]
REDIS_HOSTS = [url.strip() for url in (REDIS_URL or "").split(",") if url.strip()]  # each a shard
REALTIME_KEY_PREFIX = os.environ.get("REALTIME_KEY_PREFIX", "realtime")
if REDIS_URL and os.environ.get("REALTIME_CHANNEL_LAYER") == "pubsub":
    # channels-redis' other layer: the backplane carries the cluster on either.
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
            "CONFIG": {"hosts": REDIS_HOSTS, "prefix": f"{REALTIME_KEY_PREFIX}:asgi"},
        }
    }
elif REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": REDIS_HOSTS,
                "prefix": f"{REALTIME_KEY_PREFIX}:asgi",
                # Application consumers' channels (not the backplane's, which has its own
                # pub/sub): a channel over capacity drops what is sent to it, silently.
                "capacity": 1000,
            },
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

REALTIME_APP = {
    # "auto" (Redis when REDIS_URL is set, else one process) or "postgres": a cluster on
    # DATABASE_URL's PostgreSQL alone.
    "BACKPLANE": os.environ.get("REALTIME_BACKPLANE", "auto"),
    "KEY_PREFIX": REALTIME_KEY_PREFIX,
    "LEASE_TTL_MS": int(os.environ.get("REALTIME_LEASE_TTL_MS", "3000")),
    "MAX_BACKPRESSURE": int(os.environ.get("REALTIME_MAX_BACKPRESSURE", str(4 * 1024 * 1024))),
    "BACKPRESSURE_POLICY": os.environ.get("REALTIME_BACKPRESSURE_POLICY", "drop"),
    "CLOSE_AFTER_DROPS": int(os.environ.get("REALTIME_CLOSE_AFTER_DROPS", "1000")),
    "METRICS_TOKEN": os.environ.get("REALTIME_METRICS_TOKEN") or None,
    "NEVER_DROP_RESPONSES": os.environ.get("REALTIME_NEVER_DROP_RESPONSES", "1") == "1",
    "SLOW_CONSUMER_BYTES": int(os.environ.get("REALTIME_SLOW_CONSUMER_BYTES", str(1024 * 1024))),
    "POLICIES": [
        {"pattern": "atelier:", "authenticated": True},
        {"pattern": "demo:events", "publish": True},
    ],
    # /demo/heavy/ allocates 20 MB: two at a time, fifty waiting at most, ten seconds each.
    # The publish API: four publishing requests at once, a hundred waiting, five seconds each.
    "HTTP_POOLS": {
        "heavy": {"max_concurrent": 2, "max_waiting": 50, "wait_timeout_ms": 10000, "paths": ["/demo/heavy/"]},
        "publish": {
            "max_concurrent": 4,
            "max_waiting": 100,
            "wait_timeout_ms": 5000,
            "paths": ["/realtime/api/publish"],
        },
    },
    # Keys of the HTTP publish API (docs/auth.md): comma-separated in the environment; the
    # DEBUG demo has one of its own, "demo-publish-key".
    "PUBLISH_API_KEYS": [
        key
        for key in os.environ.get("REALTIME_PUBLISH_API_KEYS", "demo-publish-key" if DEBUG else "").split(",")
        if key
    ],
}
if REDIS_CLUSTER:
    REALTIME_APP["REDIS_CLUSTER"] = REDIS_CLUSTER

AUTH_PASSWORD_VALIDATORS: list[dict[str, str]] = []  # demo users have demo passwords
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = os.environ.get("DJANGO_STATIC_ROOT") or BASE_DIR / "staticfiles"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {"realtime_app": {"level": os.environ.get("REALTIME_LOG_LEVEL", "INFO")}},
}
