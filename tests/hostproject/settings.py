"""The host project's settings. Environment: HOST_DATABASE (an SQLite file), HOST_REDIS_URL
and HOST_KEY_PREFIX (this run's own keys), HOST_ORDER_PATTERN (the pattern of the order
rule: a typo of it is what the tests try)."""

import os

SECRET_KEY = "host-project-test-key"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "daphne",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "channels",
    "realtime_app",
    "tests.hostproject.shop",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "tests.hostproject.urls"
ASGI_APPLICATION = "tests.hostproject.asgi.application"
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ.get("HOST_DATABASE", ":memory:")}}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

_redis = os.environ.get("HOST_REDIS_URL", "redis://127.0.0.1:6379/0")
_prefix = os.environ.get("HOST_KEY_PREFIX", "host")
CHANNEL_LAYERS = {
    # The project's own layers, as channels-redis documents them: nothing tuned for the app.
    "default": {"BACKEND": "channels_redis.core.RedisChannelLayer", "CONFIG": {"hosts": [_redis], "prefix": _prefix}},
    "pubsub": {
        "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer",
        "CONFIG": {"hosts": [_redis], "prefix": f"{_prefix}:pubsub"},
    },
}
REALTIME_APP = {
    "KEY_PREFIX": f"{_prefix}:realtime",
    "POLICIES": [{"pattern": os.environ.get("HOST_ORDER_PATTERN", "order:<int:id>"), "authenticated": True}],
}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
