"""The public API: what ``realtime_app`` exports exists, and pure modules need no Django."""

import importlib
import os
import subprocess
import sys

import realtime_app

PUBLIC_MODULES = [
    "adaptive",
    "admission",
    "backplane",
    "backplane_memory",
    "backplane_redis",
    "backpressure",
    "checks",
    "client",
    "conf",
    "consumers",
    "exceptions",
    "guard",
    "hub",
    "limiter",
    "logsafe",
    "middleware",
    "names",
    "policies",
    "probes",
    "protocol",
    "publishing",
    "rate",
    "reconciler",
    "registry",
    "scenarios",
    "sessions",
    "transports",
    "workers",
    "write_behind",
]


def test_every_top_level_name_resolves_and_is_listed_once():
    assert len(realtime_app.__all__) == len(set(realtime_app.__all__))
    for name in realtime_app.__all__:
        assert getattr(realtime_app, name) is not None


def test_every_public_module_declares_what_it_exports():
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(f"realtime_app.{module_name}")
        assert module.__all__, module_name
        for name in module.__all__:
            assert hasattr(module, name), f"{module_name}.{name}"


def test_top_level_names_come_from_the_submodules():
    exported = {name for m in PUBLIC_MODULES for name in importlib.import_module(f"realtime_app.{m}").__all__}
    assert set(realtime_app.__all__) <= exported


def test_pure_modules_import_without_a_django_project():
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    code = (
        "import realtime_app.wire.rate, realtime_app.client.adaptive, realtime_app.outbound.backpressure, "
        "realtime_app.wire.protocol, realtime_app.wire.names, realtime_app.client.scenarios, "
        "realtime_app.hub.reconciler, realtime_app.observability.logsafe, "
        "realtime_app.inbound.admission; "
        "from realtime_app import rate_channel, AdaptiveRate, decide_send; "
        "print(rate_channel('a', 2000, 1000))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "a:2000"
